// Engine creation: placement of every chunk's state, budgets, allocations and initial values;
// the public methods that only forward to Impl.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "checkpoint/checkpoint_files.h"
#include "engine/engine_impl.h"
#include "engine/host_memory.h"
#include "strata/core/bytes.h"
#include "strata/core/log.h"
#include "strata/offload/ranks.h"

namespace strata::offload {

// ---- Placement and budgets ----

namespace {

/// The device budget the engine may use: what the device may still hand out. The device's own
/// budget is the one source of truth (its creator sized it, e.g. from cuda_memory_bytes); the
/// hardware's free memory only lowers it.
uint64_t DeviceBudgetBytes(const Device& device) {
  const DeviceMemoryInfo info = device.memory_info();
  const uint64_t budget_left =
      info.budget_bytes > info.used_bytes ? info.budget_bytes - info.used_bytes : 0;
  return std::min(info.free_bytes, budget_left);
}

/// Host budget a staging pool of `count` buffers of `bytes` takes.
uint64_t StagingPoolBytes(size_t bytes, int count) {
  return AlignUp(bytes, kHostAlignment) * uint64_t(count);
}

Result<AlignedBuffer> AllocateZeroed(size_t bytes) {
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer buffer, AlignedBuffer::Allocate(bytes));
  std::memset(buffer.data(), 0, buffer.size());
  return buffer;
}

}  // namespace

Engine::Impl::Impl(const EngineOptions& options, Device& device, ChunkLayout layout,
                   EngineEnvironment environment)
    : options_(options),
      device_(device),
      layout_(std::move(layout)),
      environment_(std::move(environment)),
      device_budget_(Tier::kDevice, DeviceBudgetBytes(device)),
      host_budget_(Tier::kHost, HostBudgetBytes(options, environment_.ranks_on_node)),
      nvme_budget_(Tier::kNvme, 0) {}

Engine::Impl::~Impl() {
  // Journeys of a gated step whose verdict never came (the trainer stopped mid-backward) give up;
  // everything else started (a step, updates begun during backward, fetches, preloads) ends.
  boost::asio::post(loop_.executor(), [this] { pipeline_.Cancel(); });
  WaitIdle();
  // Collectives still queued would run on the chunks' buffers freed below: the communicator
  // drains them (or fails them) first.
  environment_.communicator.reset();
  // Copies queued on the device's streams (even by a Create that failed half-way) read and
  // write buffers freed below.
  device_.Synchronize().IgnoreError();
  // Preloaded states hold staging buffers, which must go back before the pool is destroyed.
  if (!chunks_.empty()) loop_.Run(pipeline_.preloader().DropAll());
  // The threads that post to the loop may still be inside a post whose completion has already
  // run: join them before the loop goes. Stream threads are drained above; jobs and the
  // I/O thread are waited for here.
  jobs_in_flight_.WaitForAll();
  swap_.reset();
  io_.reset();
}

void Engine::Impl::Spawn(Awaitable<void> work) {
  {
    std::lock_guard lock(work_mutex_);
    ++work_running_;
  }
  boost::asio::co_spawn(loop_.executor(), std::move(work), [this](std::exception_ptr) {
    std::lock_guard lock(work_mutex_);
    if (--work_running_ == 0) work_idle_.notify_all();
  });
}

void Engine::Impl::WaitIdle() {
  std::unique_lock lock(work_mutex_);
  work_idle_.wait(lock, [&] { return work_running_ == 0; });
}

Status Engine::Impl::Initialize(std::span<const ParameterSpec> parameters) {
  const size_t n_chunks = layout_.chunk_count();
  const size_t wsize = working_size();
  const int gas = options_.optimizer.gradient_accumulation_steps;
  const PlacementOptions& place = options_.placement;

  if (environment_.communicator == nullptr) {
    environment_.communicator = CreateSingleRankCommunicator();
  }
  rank_ = environment_.communicator->rank();  // Create built the layout for its size.
  STRATA_RETURN_IF_ERROR(CheckShardable());
  // (EngineOptions::Validate refused device-kept states with offloaded parameters.)
  const bool wants_device_states =
      place.optimizer_states == Tier::kDevice || place.offload_ratio < 1.0;
  // The device passed decides, whatever options.device says: the CPU must not touch a GPU's
  // memory.
  if (wants_device_states && device_.properties().kind == DeviceKind::kCuda) {
    return Unavailable(
        "optimizer steps on a CUDA device are not built yet (they come with the GPU kernels); "
        "place optimizer states on host or nvme with offload_ratio 1");
  }

  // --- Where each chunk lives ---
  chunks_ = std::vector<Chunk>(n_chunks);
  uint64_t params_in_host = 0;
  for (size_t i = 0; i < n_chunks; ++i) {
    Chunk& c = chunks_[i];
    c.numel = layout_.chunk(i).numel;
    c.shard = layout_.shard(i, rank());
    c.segments = layout_.ShardSegments(i, rank());
    c.placement.params = place.params;
    // Frozen chunks stay whole on every rank: they have no optimizer step to share.
    c.params_sharded = gathers_params() && !layout_.chunk(i).frozen;
    if (place.params == Tier::kNvme &&
        params_in_host + c.param_home_bytes(wsize) <= place.max_params_in_host) {
      c.placement.params = Tier::kHost;  // Within max_params_in_host: cached in host memory.
      params_in_host += c.param_home_bytes(wsize);
    }
    if (layout_.chunk(i).frozen) {
      c.placement.optimizer_states.reset();
    } else {
      c.placement.optimizer_states = place.optimizer_states;
    }
  }

  STRATA_ASSIGN_OR_RETURN(zeros_, AllocateZeroed(max_trained_numel() * wsize));

  // --- Device: working parameters and gradients of device-home chunks ---
  for (size_t i = 0; i < n_chunks; ++i) {
    Chunk& c = chunks_[i];
    if (c.params_offloaded()) continue;
    const uint64_t bytes = c.device_slot_bytes(working_dtype());
    Status reserved = device_budget_.Reserve(
        bytes, "the working parameters and gradients of chunk " + std::to_string(i));
    if (!reserved.ok()) {
      uint64_t needed = 0;
      for (const Chunk& other : chunks_) needed += other.device_slot_bytes(working_dtype());
      return ResourceExhausted(
          "device memory budget of " + FormatBytes(device_budget_.usage().budget_bytes) +
          " cannot hold the working parameters and gradients (" + FormatBytes(needed) +
          "); offload the parameters (placement.params host or nvme) or "
          "raise the device budget");
    }
    static_reservations_.emplace_back(&device_budget_, bytes);
    STRATA_ASSIGN_OR_RETURN(c.params, device_.Allocate(c.working_bytes(wsize)));
    if (c.frozen()) continue;
    STRATA_ASSIGN_OR_RETURN(c.grads, device_.Allocate(c.working_bytes(wsize)));
    STRATA_RETURN_IF_ERROR(
        device_.CopyToDevice(c.grads.data(), zeros_.data(), c.working_bytes(wsize)));
  }

  // --- Device: optimizer states kept there (all of them, or the 1 - ratio share) ---
  std::vector<size_t> trained;  // Chunks with optimizer states.
  for (size_t i = 0; i < n_chunks; ++i) {
    if (!chunks_[i].frozen()) trained.push_back(i);
  }
  size_t wanted_device_states = 0;
  if (place.optimizer_states == Tier::kDevice) {
    wanted_device_states = trained.size();
  } else if (place.offload_ratio < 1.0) {
    wanted_device_states =
        static_cast<size_t>(std::llround((1.0 - place.offload_ratio) * trained.size()));
  }
  // The first chunks stay: backward produces their gradients last, so the CPU gets the chunks
  // whose gradients arrive first and the most time to update them.
  for (size_t k = 0; k < wanted_device_states; ++k) {
    const size_t i = trained[k];
    Chunk& c = chunks_[i];
    const uint64_t bytes = c.state_bytes() + (gas > 1 ? c.numel * sizeof(float) : 0);
    if (!device_budget_.TryReserve(bytes)) {
      if (place.optimizer_states == Tier::kDevice) {
        return ResourceExhausted(
            "device memory budget of " + FormatBytes(device_budget_.usage().budget_bytes) +
            " cannot hold the optimizer states of chunk " + std::to_string(i) + " (" +
            FormatBytes(bytes) + " more; " + FormatBytes(device_budget_.usage().used_bytes) +
            " in use); offload them (offload_optimizer.device cpu or nvme)");
      }
      Log(LogLevel::kWarning, "offload_ratio " + std::to_string(place.offload_ratio) + " keeps " +
                                  std::to_string(wanted_device_states) +
                                  " chunks' optimizer states on the device, but only " +
                                  std::to_string(k) + " fit in its memory budget");
      break;
    }
    static_reservations_.emplace_back(&device_budget_, bytes);
    c.placement.optimizer_states = Tier::kDevice;
    STRATA_ASSIGN_OR_RETURN(c.device_states, device_.Allocate(c.state_bytes()));
    if (gas > 1) {
      STRATA_ASSIGN_OR_RETURN(c.device_grads_sum, device_.Allocate(c.numel * sizeof(float)));
    }
  }
  for (Chunk& c : chunks_) {
    if (c.placement.optimizer_states == Tier::kDevice && !c.device_states.valid()) {
      c.placement.optimizer_states = Tier::kHost;  // Did not fit: the CPU updates it.
    }
  }
  // States homed on NVMe fill max_states_in_host first, in the same order: the chunks whose
  // gradients arrive last, with the least time left to read their states, read nothing. A
  // chunk too large for what is left (an embedding) goes to NVMe and the next ones still fill.
  uint64_t states_in_host = 0;
  for (size_t i : trained) {
    Chunk& c = chunks_[i];
    if (c.placement.optimizer_states != Tier::kNvme) continue;
    if (states_in_host + c.state_bytes() > place.max_states_in_host) continue;
    c.placement.optimizer_states = Tier::kHost;
    states_in_host += c.state_bytes();
  }

  // Offloaded parameters fetch into whatever the device has left: it must hold any one chunk.
  if (place.params != Tier::kDevice) {
    uint64_t slot = 0;
    for (const Chunk& c : chunks_)
      slot = std::max<uint64_t>(slot, c.device_slot_bytes(working_dtype()));
    if (device_budget_.free_bytes() < slot) {
      return ResourceExhausted(
          "device memory budget of " + FormatBytes(device_budget_.usage().budget_bytes) +
          " cannot hold one chunk's working parameters and gradients (the largest needs " +
          FormatBytes(slot) + ", " + FormatBytes(device_budget_.free_bytes()) +
          " free); lower placement.chunk_bytes or raise the device budget");
    }
  }

  STRATA_RETURN_IF_ERROR(CheckDelayedUpdatePlacement());

  // --- Host ---
  auto host_alloc = [&](AlignedBuffer& out, size_t bytes, const std::string& what) -> Status {
    if (bytes == 0) return Status();
    STRATA_RETURN_IF_ERROR(host_budget_.Reserve(
        AlignUp(bytes, kHostAlignment),
        what + " (set host.pinned_memory_bytes higher, or offload more to nvme)"));
    static_reservations_.emplace_back(&host_budget_, AlignUp(bytes, kHostAlignment));
    STRATA_ASSIGN_OR_RETURN(out, AllocateZeroed(bytes));
    return Status();
  };
  // Stage 3's host slots that chunks' parameters are gathered into (for the chunk acquired and
  // the prefetch depth's), before spilling states or sizing staging: both fit what is left.
  if (std::any_of(chunks_.begin(), chunks_.end(),
                  [](const Chunk& c) { return c.params_sharded; })) {
    const size_t slots = size_t(std::max(0, place.prefetch_depth)) + 1;
    const size_t bytes = max_trained_numel() * wsize;
    const uint64_t total =
        slots * (AlignUp(bytes, kHostAlignment) + param_gather_.SlotExtraBytes());
    STRATA_RETURN_IF_ERROR(host_budget_.Reserve(
        total, "the " + std::to_string(slots) +
                   " buffers stage 3 gathers parameters into (placement.prefetch_depth + 1)"));
    static_reservations_.emplace_back(&host_budget_, total);
    STRATA_RETURN_IF_ERROR(param_gather_.Initialize(slots, bytes));
  }
  if (reduces_from_ring() && max_trained_numel() > 0) {
    // Two: one chunk's gradients are widened while the one before is reduced, and the widening
    // is far quicker than the link.
    constexpr size_t kSlots = 2;
    // Quantized gradients: every rank's partition of the largest chunk, sent and received.
    const size_t quantized =
        quantizes_gradients()
            ? cpu_adam::QuantizedBytes(max_trained_shard_numel(), gradient_quant_bits()) *
                  size_t(ranks())
            : 0;
    // Reducing every micro-step in fp32: the shard each reduce-scatter writes, which the journey
    // then adds into the chunk's.
    const size_t output =
        reduces_each_micro_step() && !quantizes_gradients() ? max_trained_shard_numel() : 0;
    const uint64_t total = kSlots * (AlignUp(max_trained_numel() * sizeof(float), kHostAlignment) +
                                     2 * AlignUp(quantized, kHostAlignment) +
                                     AlignUp(output * sizeof(float), kHostAlignment));
    STRATA_RETURN_IF_ERROR(host_budget_.Reserve(
        total, "the " + std::to_string(kSlots) +
                   " buffers gradients are reduced across ranks from (set host.pinned_memory_bytes "
                   "higher, or lower placement.chunk_bytes)"));
    static_reservations_.emplace_back(&host_budget_, total);
    STRATA_RETURN_IF_ERROR(reduce_ring_.Initialize(kSlots, max_trained_numel(), quantized, output));
  }
  SpillStatesToNvme();
  for (size_t i = 0; i < n_chunks; ++i) {
    for (const HostBuffer& b : HostBuffersOf(i)) {
      STRATA_RETURN_IF_ERROR(host_alloc(*b.buffer, b.bytes, b.what));
    }
  }
  // Gradients land in, and new parameters leave from, pinned memory so device copies run at
  // full speed; host-home parameters are pinned too when host.pin_memory asks for it.
  if (device_.CanPin()) {
    for (Chunk& c : chunks_) {
      std::vector<AlignedBuffer*> buffers = {&c.grads_landing, &c.param_copy, &c.delayed_params};
      if (options_.host.pin_memory) buffers.push_back(&c.host_params);
      for (AlignedBuffer* buffer : buffers) {
        if (buffer->empty()) continue;
        STRATA_ASSIGN_OR_RETURN(PinnedHostRegion region,
                                device_.PinHostMemory(buffer->data(), buffer->size()));
        pinned_.push_back(std::move(region));
      }
    }
  }

  // --- NVMe ---
  uint64_t nvme_bytes = 0;
  bool nvme_states = false;
  bool nvme_params = false;
  for (const Chunk& c : chunks_) {
    if (c.placement.optimizer_states == Tier::kNvme) {
      nvme_bytes += 2 * AlignUp(c.state_bytes(), kMiB);
      nvme_states = true;
    }
    if (c.placement.params == Tier::kNvme) {
      nvme_bytes += 2 * AlignUp(c.param_home_bytes(wsize), kMiB);
      nvme_params = true;
    }
  }
  transactional_ = nvme_states || nvme_params;
  if (nvme_bytes > 0) {
    const NvmeOptions& nv = options_.nvme;
    if (nv.paths.empty()) {
      return InvalidArgument("state is placed on nvme but nvme.paths is empty (set nvme_path)");
    }
    STRATA_ASSIGN_OR_RETURN(
        io_, nvme::IoEngine::Create({.backend = nv.backend,
                                     .block_size = nv.block_size,
                                     .queue_depth = static_cast<uint32_t>(nv.queue_depth),
                                     .wrap_backend = environment_.wrap_io_backend}));
    const uint64_t per_path = AlignUp(nvme_bytes / nv.paths.size() + 16 * kMiB, kMiB);
    STRATA_ASSIGN_OR_RETURN(
        swap_, nvme::SwapSpace::Create({.paths = nv.paths,
                                        .bytes_per_path = per_path,
                                        .direct_io = nv.direct_io,
                                        .allow_buffered_fallback = nv.allow_buffered_fallback,
                                        .checksums = nv.checksums},
                                       *io_));
    nvme_budget_.SetBudget(swap_->capacity_bytes());
    for (size_t i = 0; i < n_chunks; ++i) {
      Chunk& c = chunks_[i];
      for (int k = 0; k < 2; ++k) {
        if (c.placement.optimizer_states == Tier::kNvme) {
          STRATA_ASSIGN_OR_RETURN(c.state_extents[k], swap_->Allocate(c.state_bytes()));
          STRATA_RETURN_IF_ERROR(nvme_budget_.Reserve(c.state_bytes(), "optimizer states"));
          static_reservations_.emplace_back(&nvme_budget_, c.state_bytes());
        }
        if (c.placement.params == Tier::kNvme) {
          const size_t bytes = c.param_home_bytes(wsize);
          STRATA_ASSIGN_OR_RETURN(c.param_extents[k], swap_->Allocate(bytes));
          STRATA_RETURN_IF_ERROR(nvme_budget_.Reserve(bytes, "parameters"));
          static_reservations_.emplace_back(&nvme_budget_, bytes);
        }
      }
    }
    auto make_pool = [&](size_t bytes, int count,
                         const char* what) -> Result<std::unique_ptr<StagingPool>> {
      const uint64_t total = StagingPoolBytes(bytes, count);
      STRATA_RETURN_IF_ERROR(host_budget_.Reserve(total, what));
      static_reservations_.emplace_back(&host_budget_, total);
      return StagingPool::Create(
          {.buffer_bytes = bytes, .buffer_count = size_t(count), .pin_with = &device_});
    };
    // Parameter staging first: automatic state staging takes what the budget has left.
    if (nvme_params) {
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<StagingPool> pool,
                              make_pool(max_nvme_param_bytes(), options_.host.param_buffer_count,
                                        "the parameter staging buffers"));
      param_staging_.emplace(std::move(pool));
    }
    if (nvme_states) {
      const size_t bytes = ChunkStateBytes(max_nvme_state_numel());
      const size_t nvme_chunks = size_t(std::count_if(chunks_.begin(), chunks_.end(), [](auto& c) {
        return c.placement.optimizer_states == Tier::kNvme;
      }));
      const int count =
          StateBufferCount(options_.host, nvme_chunks, AlignUp(bytes, kHostAlignment),
                           StateStagingRoom(host_budget_.free_bytes(), SpeculationBytes()));
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<StagingPool> pool,
                              make_pool(bytes, count, "the optimizer state staging buffers"));
      Log(LogLevel::kInfo,
          "optimizer states on NVMe: " + std::to_string(count) + " staging buffers of " +
              FormatBytes(bytes) + " (" + FormatBytes(StagingPoolBytes(bytes, count)) +
              " of host memory): the reads of " +
              std::to_string(std::min(StatePreloader::ReadAheadDepth(size_t(count)), nvme_chunks)) +
              " of " + std::to_string(nvme_chunks) + " chunks run ahead of backward" +
              (options_.host.optimizer_buffer_count > 0 ? " (host.optimizer_buffer_count)" : ""));
      pipeline_.preloader().Open(std::move(pool), *io_, *swap_);
    }
  }

  AllocateStateShadows();

  // --- Initial values: master = given values (padding zero), moments zero; a frozen chunk's
  // "states" are just the values (Chunk::state_bytes). With several ranks, the states hold
  // this rank's shard of the master, and the working parameters come from the whole of it ---
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer states, AlignedBuffer::Allocate(max_state_bytes()));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer whole,
                          AlignedBuffer::Allocate(layout_.max_chunk_numel() * sizeof(float)));
  for (size_t i = 0; i < n_chunks; ++i) {
    const ChunkInfo& info = layout_.chunk(i);
    const Chunk& c = chunks_[i];
    auto* master = reinterpret_cast<float*>(whole.data());
    std::memset(master, 0, c.numel * sizeof(float));
    for (size_t p = info.first_parameter; p < info.first_parameter + info.parameter_count; ++p) {
      const std::span<const float> values = parameters[p].initial_values;
      if (!values.empty())
        std::copy(values.begin(), values.end(), master + layout_.location(p).offset);
    }
    std::memset(states.data(), 0, c.state_bytes());
    const size_t own = c.frozen() ? 0 : c.shard.begin;
    const size_t own_numel = c.frozen() ? c.numel : c.shard.numel();
    std::memcpy(states.data(), master + own, own_numel * sizeof(float));
    STRATA_RETURN_IF_ERROR(WriteNvmeHome(i, states.data(), /*shadow=*/false));
    STRATA_RETURN_IF_ERROR(WriteMemoryHome(i, states.data(), master));
  }
  STRATA_ASSIGN_OR_RETURN(compute_marker_, device_.CreateEvent());
  STRATA_RETURN_IF_ERROR(residency_.Initialize());

  STRATA_ASSIGN_OR_RETURN(cpu_adam::CpuOptimizer optimizer,
                          cpu_adam::CpuOptimizer::Create(
                              {.threads = OptimizerThreads(options_, environment_.ranks_on_node)}));
  optimizer_.emplace(std::move(optimizer));
  m_.Register(metrics_);
  m_.loss_scale->Set(pipeline_.loss_scale());
  UpdateTierGauges();
  pipeline_.Initialize();
  return Status();
}

std::optional<AlignedBuffer> Engine::Impl::AllocateWithinBudget(size_t bytes) {
  const uint64_t size = AlignUp(bytes, kHostAlignment);
  if (!host_budget_.TryReserve(size)) return std::nullopt;
  BudgetReservation reserved(&host_budget_, size);
  Result<AlignedBuffer> buffer = AlignedBuffer::Allocate(bytes);
  if (!buffer.ok()) return std::nullopt;  // The reservation goes with it.
  static_reservations_.push_back(std::move(reserved));
  return std::move(*buffer);
}

void Engine::Impl::AllocateParamsBefore() {
  // NVMe-kept chunks need no second states (their update goes to shadow extents), but their
  // speculative parameters can go up early if the ones before are kept here, to put back on a
  // roll-back; a chunk without room holds its upload back to the verdict instead. After the
  // host shadows, which decide whether host-kept chunks speculate at all.
  size_t wanted = 0, given = 0;
  uint64_t bytes = 0;
  for (size_t i = chunks_.size(); i-- > 0;) {
    Chunk& c = chunks_[i];
    if (!WantsParamsBefore(c)) continue;
    ++wanted;
    const size_t wbytes = c.working_bytes(working_size());
    std::optional<AlignedBuffer> copy = AllocateWithinBudget(wbytes);
    if (!copy) continue;
    c.params_before = std::move(*copy);
    ++given;
    bytes += AlignUp(wbytes, kHostAlignment);
  }
  if (wanted == 0) return;
  Log(LogLevel::kInfo,
      "speculative updates: " + std::to_string(given) + " of " + std::to_string(wanted) +
          " chunks with optimizer states on NVMe keep their parameters from before an update (" +
          FormatBytes(bytes) + " of host memory) and upload the new ones as soon as they are made" +
          (given < wanted ? "; the others upload theirs once the global gradient norm is known"
                          : ""));
}

bool Engine::Impl::Speculates() const {
  // (Several ranks do not speculate yet: step_pipeline.h, "Sharding".)
  return options_.optimizer.speculative_updates && pipeline_.gated() && !sharded();
}

bool Engine::Impl::WantsStateShadow(const Chunk& c) const {
  return Speculates() && !c.frozen() && c.placement.optimizer_states == Tier::kHost;
}

bool Engine::Impl::WantsParamsBefore(const Chunk& c) const {
  return Speculates() && !c.frozen() && c.placement.optimizer_states == Tier::kNvme &&
         c.placement.params == Tier::kDevice;
}

uint64_t Engine::Impl::SpeculationBytes() const {
  uint64_t bytes = 0;
  for (const Chunk& c : chunks_) {
    if (WantsStateShadow(c)) bytes += AlignUp(c.state_bytes(), kHostAlignment);
    if (WantsParamsBefore(c)) bytes += AlignUp(c.working_bytes(working_size()), kHostAlignment);
  }
  return bytes;
}

void Engine::Impl::AllocateStateShadows() {
  if (!Speculates()) return;
  size_t wanted = 0, given = 0;
  uint64_t bytes = 0, missing = 0;
  // Backward order: the chunks whose gradients land first have the most backward left to
  // overlap their updates with.
  for (size_t i = chunks_.size(); i-- > 0;) {
    Chunk& c = chunks_[i];
    if (!WantsStateShadow(c)) continue;
    ++wanted;
    const uint64_t size = AlignUp(c.state_bytes(), kHostAlignment);
    // Not zeroed here: WriteMemoryHome fills it with the initial states, as host_states.
    std::optional<AlignedBuffer> shadow = AllocateWithinBudget(c.state_bytes());
    if (!shadow) {
      missing += size;
      continue;
    }
    c.host_state_shadow = std::move(*shadow);
    ++given;
    bytes += size;
  }
  AllocateParamsBefore();
  if (wanted == 0) return;
  std::string message = "speculative updates: " + std::to_string(given) + " of " +
                        std::to_string(wanted) +
                        " chunks with optimizer states in host memory have room for a second "
                        "buffer of them (" +
                        FormatBytes(bytes) + " of host memory) and update during backward";
  if (given < wanted) {
    message += "; the other " + std::to_string(wanted - given) +
               " wait for the global gradient norm at the end of backward (" +
               FormatBytes(missing) +
               " more of host.pinned_memory_bytes would let them update during backward)";
  }
  Log(LogLevel::kInfo, message + "; optimizer.speculative_updates = false saves the buffers");
}

Status Engine::Impl::CheckDelayedUpdatePlacement() const {
  if (!options_.optimizer.delayed_update) return Status();
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    if (c.frozen()) continue;
    if (c.placement.params != Tier::kDevice) {
      return InvalidArgument(
          "optimizer.delayed_update needs the trained parameters on the device, but chunk " +
          std::to_string(i) + "'s live in " + std::string(TierName(c.placement.params)) +
          " memory; set placement.params to device (strata train: --offload-params device)");
    }
    if (c.placement.optimizer_states == Tier::kDevice) {
      return InvalidArgument(
          "optimizer.delayed_update needs every trained chunk's optimizer states off the "
          "device (the device steps its own at once), but chunk " +
          std::to_string(i) + "'s are kept there; set placement.offload_ratio to 1");
    }
  }
  return Status();
}

std::vector<Engine::Impl::HostBuffer> Engine::Impl::HostBuffersOf(size_t chunk) {
  Chunk& c = chunks_[chunk];
  const size_t wsize = working_size();
  const std::string name = "chunk " + std::to_string(chunk);
  std::vector<HostBuffer> buffers;
  // Stage 3 keeps this rank's shard of a trained chunk's working parameters (ParamGather).
  const size_t param_bytes = c.param_home_bytes(wsize);
  if (c.placement.params == Tier::kHost) {
    buffers.push_back({&c.host_params, param_bytes, "the parameters of " + name});
  }
  // Frozen chunks have no gradients; device-kept ones keep theirs there.
  if (c.frozen() || c.placement.optimizer_states == Tier::kDevice) return buffers;
  buffers.push_back({&c.grads_landing, c.working_bytes(wsize), "the gradients of " + name});
  if (sums_micro_steps()) {
    buffers.push_back({&c.grads_sum, c.numel * sizeof(float), "the gradient sum of " + name});
  }
  if (sharded()) {
    buffers.push_back({&c.grads_shard, c.shard.numel() * sizeof(float),
                       "this rank's shard of the gradients of " + name});
  }
  if (c.placement.params != Tier::kNvme) {
    buffers.push_back({&c.param_copy, param_bytes, "the updated working parameters of " + name});
  }
  if (options_.optimizer.delayed_update) {
    buffers.push_back(
        {&c.delayed_params, c.working_bytes(wsize),
         "the delayed working parameters of " + name + " (optimizer.delayed_update)"});
  }
  if (c.placement.optimizer_states == Tier::kHost) {
    const bool kept_by_option = options_.placement.max_states_in_host > 0;
    buffers.push_back(
        {&c.host_states, c.state_bytes(),
         "the optimizer states of " + name +
             (kept_by_option ? " (kept there by placement.max_states_in_host: lower it)" : "")});
  }
  return buffers;
}

uint64_t Engine::Impl::HostBytesNeeded() {
  uint64_t bytes = 0;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    for (const HostBuffer& b : HostBuffersOf(i)) {
      if (b.bytes > 0) bytes += AlignUp(b.bytes, kHostAlignment);
    }
  }
  if (const size_t numel = max_nvme_state_numel(); numel > 0) {
    bytes += StagingPoolBytes(ChunkStateBytes(numel), MinStateBuffers(options_.host));
  }
  if (const size_t param_bytes = max_nvme_param_bytes(); param_bytes > 0) {
    bytes += StagingPoolBytes(param_bytes, options_.host.param_buffer_count);
  }
  return bytes;
}

void Engine::Impl::SpillStatesToNvme() {
  const PlacementOptions& place = options_.placement;
  if (place.optimizer_states != Tier::kHost || options_.nvme.paths.empty()) return;
  const uint64_t budget = host_budget_.free_bytes();
  const uint64_t need = HostBytesNeeded();  // No states on NVMe yet: no state staging in it.
  if (need <= budget) return;
  // The chunks to spill for a cap on their size (NVMe states need staging buffers as large as
  // the largest of them): from the last chunk back, skipping larger ones, until the rest fits.
  auto spill_under = [&](size_t cap) {
    std::vector<size_t> spill;
    uint64_t left = need, staging = 0;
    size_t largest = 0;
    for (size_t i = chunks_.size(); i-- > 0 && left > budget;) {
      const Chunk& c = chunks_[i];
      if (c.placement.optimizer_states != Tier::kHost || c.numel > cap) continue;
      spill.push_back(i);
      left -= AlignUp(c.state_bytes(), kHostAlignment);
      largest = std::max(largest, c.numel);
      const uint64_t now =
          StagingPoolBytes(ChunkStateBytes(largest), MinStateBuffers(options_.host));
      left += now - staging;
      staging = now;
    }
    return left <= budget ? spill : std::vector<size_t>{};
  };
  // The smallest cap that fits: a large last chunk (an untied lm_head) stays in host memory
  // when spilling smaller ones is enough, instead of sizing every staging buffer by it.
  std::vector<size_t> sizes;
  for (const Chunk& c : chunks_) {
    if (c.placement.optimizer_states == Tier::kHost) sizes.push_back(c.numel);
  }
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (size_t cap : sizes) {
    const std::vector<size_t> spill = spill_under(cap);
    if (spill.empty()) continue;
    for (size_t i : spill) chunks_[i].placement.optimizer_states = Tier::kNvme;
    Log(LogLevel::kWarning,
        "the host budget of " + FormatBytes(host_budget_.usage().budget_bytes) +
            " cannot hold every chunk's optimizer states: " + std::to_string(spill.size()) +
            (spill.size() == 1 ? " chunk's states spill" : " chunks' states spill") + " to NVMe (" +
            options_.nvme.paths.front() +
            "), the others stay in host memory; raise host.pinned_memory_bytes to keep more");
    return;
  }
  // No spill fits: everything stays, and the host allocation that fails says what.
}

Status Engine::Impl::CheckShardable() const {
  if (!sharded()) return Status();
  const PlacementOptions& place = options_.placement;
  const std::string across = "across " + std::to_string(ranks()) + " ranks: ";
  if (place.zero_stage == 0) {
    return Unavailable(across +
                       "plain data parallelism (zero_optimization.stage 0) is not built; stages "
                       "1 and 2 shard the optimizer states");
  }
  if (place.zero_stage == 3 && place.params == Tier::kDevice) {
    return Unavailable(across +
                       "zero_optimization.stage 3 keeps each rank's shard of the parameters in "
                       "host memory or on NVMe and gathers a chunk's on Acquire: set "
                       "offload_param cpu or nvme (shards kept on the device are not built yet)");
  }
  if (place.zero_stage != 3 && place.params != Tier::kDevice) {
    return Unavailable(across +
                       "offloaded parameters are sharded by stage 3; with stages 1 and 2 keep "
                       "them on the device (offload_param none)");
  }
  if (place.optimizer_states == Tier::kDevice || place.offload_ratio < 1.0) {
    return Unavailable(across +
                       "optimizer states kept on the device are not sharded yet; "
                       "offload them all (cpu or nvme, ratio 1)");
  }
  if (options_.optimizer.delayed_update) {
    return Unavailable(across + "the delayed parameter update is not built for several ranks");
  }
  return Status();
}

size_t Engine::Impl::max_nvme_param_bytes() const {
  size_t bytes = 0;
  for (const Chunk& c : chunks_) {
    if (c.placement.params == Tier::kNvme) {
      bytes = std::max(bytes, c.param_home_bytes(working_size()));
    }
  }
  return bytes;
}

size_t Engine::Impl::max_nvme_state_numel() const {
  size_t numel = 0;
  for (const Chunk& c : chunks_) {
    if (c.placement.optimizer_states == Tier::kNvme) numel = std::max(numel, c.shard.numel());
  }
  return numel;
}

size_t Engine::Impl::max_state_bytes() const {
  size_t bytes = 0;
  for (const Chunk& c : chunks_) bytes = std::max(bytes, c.state_bytes());
  return bytes;
}

size_t Engine::Impl::max_trained_shard_numel() const {
  size_t numel = 0;
  for (const Chunk& c : chunks_) numel = c.frozen() ? numel : std::max(numel, c.shard.numel());
  return numel;
}

size_t Engine::Impl::max_trained_numel() const {
  size_t numel = 0;
  for (const Chunk& c : chunks_) numel = c.frozen() ? numel : std::max(numel, c.numel);
  return numel;
}

Result<ChunkView> Engine::Impl::Acquire(size_t chunk) {
  if (chunk >= chunks_.size()) {
    return InvalidArgument("chunk " + std::to_string(chunk) + " does not exist (the engine has " +
                           std::to_string(chunks_.size()) + ")");
  }
  STRATA_RETURN_IF_ERROR(pipeline_.CheckReadable(chunk, "Acquire(" + std::to_string(chunk) + ")",
                                                 /*acquire=*/true));
  if (!chunks_[chunk].params_sharded || residency_.Held(chunk)) return residency_.Acquire(chunk);
  // Stage 3: every rank gathers the chunk's parameters for this Acquire, whatever its device
  // holds (see param_gather.h), and the chunks expected next ahead of time.
  const auto depth = size_t(std::max(0, options_.placement.prefetch_depth));
  STRATA_ASSIGN_OR_RETURN(const std::byte* gathered,
                          param_gather_.Take(chunk, residency_.Upcoming(chunk, depth)));
  Result<ChunkView> view = residency_.Acquire(chunk, gathered);
  param_gather_.Return(chunk);
  // The other ranks went on from this gather; a retry here would gather once more than they
  // do, and this rank's collectives would no longer match theirs.
  if (!view.ok()) param_gather_.Fail(view.status());
  return view;
}

void Engine::Impl::Release(size_t chunk, TrainerStream stream) {
  if (chunk >= chunks_.size()) return;
  residency_.Release(chunk, stream);
  pipeline_.Released(chunk);
}

Status Engine::Impl::GradsReady(size_t chunk, TrainerStream stream) {
  if (chunk >= chunks_.size()) {
    return InvalidArgument("chunk " + std::to_string(chunk) + " does not exist");
  }
  if (chunks_[chunk].frozen()) {
    return FailedPrecondition("GradsReady(" + std::to_string(chunk) +
                              "): the chunk holds frozen parameters, which take no gradients");
  }
  return pipeline_.GradsReady(chunk, stream);
}

Status Engine::Impl::RecordTrainerEvent(DeviceEvent& event, TrainerStream stream) {
  if (stream.native == nullptr) return device_.RecordEvent(event, Stream::kCompute);
  return device_.RecordEventOnNativeStream(event, stream.native);
}

// ---- Engine: forwarding ----

Result<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options, Device& device,
                                               std::span<const ParameterSpec> parameters,
                                               EngineEnvironment environment) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (environment.ranks_on_node < 0) {
    return InvalidArgument("EngineEnvironment::ranks_on_node must be >= 0 (0 = the launcher's)");
  }
  if (environment.ranks_on_node == 0) {
    STRATA_ASSIGN_OR_RETURN(RankInfo ranks, DetectRanks());
    environment.ranks_on_node = ranks.local_size;
    if (ranks.local_size > 1) {
      Log(LogLevel::kInfo, std::to_string(ranks.local_size) + " ranks on this node (" +
                               ranks.launcher +
                               "): the automatic host budget and optimizer threads are shared");
    }
  }
  const int world_size = environment.communicator ? environment.communicator->size() : 1;
  STRATA_ASSIGN_OR_RETURN(ChunkLayout layout,
                          ChunkLayout::Build(parameters, options.precision.working_dtype,
                                             options.placement.chunk_bytes, world_size));
  auto impl = std::make_unique<Impl>(options, device, std::move(layout), std::move(environment));
  STRATA_RETURN_IF_ERROR(impl->Initialize(parameters));
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

const ChunkLayout& Engine::layout() const { return impl_->layout_; }
const ChunkPlacement& Engine::placement(size_t chunk) const {
  return impl_->chunks_[chunk].placement;
}
DType Engine::working_dtype() const { return impl_->working_dtype(); }
Result<ChunkView> Engine::Acquire(size_t chunk) { return impl_->Acquire(chunk); }
void Engine::Release(size_t chunk, TrainerStream stream) { impl_->Release(chunk, stream); }
Status Engine::GradsReady(size_t chunk, TrainerStream stream) {
  return impl_->GradsReady(chunk, stream);
}
std::future<Result<StepReport>> Engine::Step() {
  impl_->param_gather_.Discard();  // Stage 3: gathers made ahead hold this step's parameters.
  return impl_->pipeline_.Step();
}
double Engine::loss_scale() const { return impl_->pipeline_.loss_scale(); }
int64_t Engine::step_count() const { return impl_->pipeline_.step_count(); }
int64_t Engine::iteration_count() const { return impl_->pipeline_.iteration_count(); }
void Engine::SetLearningRate(double lr) { impl_->pipeline_.SetLearningRate(lr); }
Status Engine::SetStepCount(int64_t steps) { return impl_->SetStepCount(steps); }
Status Engine::Save(const std::filesystem::path& dir, const SaveOptions& save_options) {
  return impl_->Save(dir, save_options);
}
Status Engine::CheckSaveTarget(const std::filesystem::path& dir) const {
  return impl_->CheckSaveTarget(dir);
}
Status Engine::Load(const std::filesystem::path& dir) { return impl_->Load(dir); }
Status Engine::ReadMasterParameter(size_t parameter, std::span<float> out) {
  return ReadParameterState(parameter, ParameterState::kMaster, out);
}
Status Engine::ReadParameterState(size_t parameter, ParameterState state, std::span<float> out) {
  const ParameterStateRead read{.parameter = parameter, .state = state, .out = out};
  return impl_->ReadParameterStates({&read, 1});
}
Status Engine::WriteParameterState(size_t parameter, ParameterState state,
                                   std::span<const float> values) {
  const ParameterStateWrite write{.parameter = parameter, .state = state, .values = values};
  return impl_->WriteParameterStates({&write, 1});
}
Status Engine::ReadParameterStates(std::span<const ParameterStateRead> reads) {
  return impl_->ReadParameterStates(reads);
}
Status Engine::WriteParameterStates(std::span<const ParameterStateWrite> writes) {
  return impl_->WriteParameterStates(writes);
}

TierUsage Engine::tier_usage(Tier tier) const {
  switch (tier) {
    case Tier::kDevice: return impl_->device_budget_.usage();
    case Tier::kHost: return impl_->host_budget_.usage();
    case Tier::kNvme: return impl_->nvme_budget_.usage();
  }
  return {};
}

EngineCounters& EngineCounters::operator+=(const EngineCounters& o) {
  device_to_host_bytes += o.device_to_host_bytes;
  host_to_device_bytes += o.host_to_device_bytes;
  nvme_read_bytes += o.nvme_read_bytes;
  nvme_write_bytes += o.nvme_write_bytes;
  optimizer_seconds += o.optimizer_seconds;
  optimizer_params += o.optimizer_params;
  device_optimizer_params += o.device_optimizer_params;
  evictions += o.evictions;
  fetches += o.fetches;
  speculative_updates += o.speculative_updates;
  rolled_back_updates += o.rolled_back_updates;
  reduce_scatter_bytes += o.reduce_scatter_bytes;
  all_gather_bytes += o.all_gather_bytes;
  return *this;
}

EngineCounters& EngineCounters::operator-=(const EngineCounters& o) {
  device_to_host_bytes -= o.device_to_host_bytes;
  host_to_device_bytes -= o.host_to_device_bytes;
  nvme_read_bytes -= o.nvme_read_bytes;
  nvme_write_bytes -= o.nvme_write_bytes;
  optimizer_seconds -= o.optimizer_seconds;
  optimizer_params -= o.optimizer_params;
  device_optimizer_params -= o.device_optimizer_params;
  evictions -= o.evictions;
  fetches -= o.fetches;
  speculative_updates -= o.speculative_updates;
  rolled_back_updates -= o.rolled_back_updates;
  reduce_scatter_bytes -= o.reduce_scatter_bytes;
  all_gather_bytes -= o.all_gather_bytes;
  return *this;
}

EngineCounters Engine::counters() const {
  const auto& m = impl_->m_;
  auto count = [](const Counter* c) { return static_cast<uint64_t>(c->Value()); };
  return {.device_to_host_bytes = count(m.d2h_bytes),
          .host_to_device_bytes = count(m.h2d_bytes),
          .nvme_read_bytes = count(m.nvme_read_bytes),
          .nvme_write_bytes = count(m.nvme_write_bytes),
          .optimizer_seconds = m.optimizer_seconds->Value(),
          .optimizer_params = count(m.optimizer_params),
          .device_optimizer_params = count(m.device_optimizer_params),
          .evictions = count(m.evictions),
          .fetches = count(m.fetches),
          .speculative_updates = count(m.speculative_updates),
          .rolled_back_updates = count(m.rolled_back_updates),
          .reduce_scatter_bytes = count(m.collective_bytes[int(CollectiveKind::kReduceScatter)]),
          .all_gather_bytes = count(m.collective_bytes[int(CollectiveKind::kAllGather)])};
}

MetricsRegistry& Engine::metrics() {
  impl_->UpdateTierGauges();
  return impl_->metrics_;
}

void Engine::Impl::UpdateTierGauges() {
  const TierBudget* budgets[kTierCount] = {&device_budget_, &host_budget_, &nvme_budget_};
  for (int t = 0; t < kTierCount; ++t) {
    const TierUsage u = budgets[t]->usage();
    m_.used_bytes[t]->Set(double(u.used_bytes));
    m_.budget_bytes[t]->Set(double(u.budget_bytes));
  }
}

}  // namespace strata::offload
