// Engine creation: where each chunk's state lives, what it takes of each tier's budget, the
// allocations and the initial values. Initialize runs the placement's steps in order, each
// deciding one thing with what the steps before it left; engine_host_placement.cpp holds what
// the host budget decides (each chunk's host buffers, the spill to NVMe, speculation's extra
// buffers).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/engine_impl.h"
#include "engine/host_memory.h"
#include "strata/core/bytes.h"
#include "strata/core/log.h"

namespace strata::offload {
namespace {

Result<AlignedBuffer> AllocateZeroed(size_t bytes) { return AlignedBuffer::AllocateZeroed(bytes); }

}  // namespace

Status Engine::Impl::Initialize(std::span<const ParameterSpec> parameters) {
  STRATA_RETURN_IF_ERROR(JoinRanks());
  STRATA_RETURN_IF_ERROR(CheckDeviceStatesBuilt());
  LayOutChunks();
  STRATA_ASSIGN_OR_RETURN(zeros_, AllocateZeroed(max_trained_numel() * working_size()));
  // Device memory first: what it cannot hold goes to the host, and what the host cannot hold
  // to NVMe.
  STRATA_RETURN_IF_ERROR(PlaceDeviceParams());
  STRATA_RETURN_IF_ERROR(PlaceDeviceStates());
  KeepStatesInHost();
  STRATA_RETURN_IF_ERROR(CheckFetchRoom());
  STRATA_RETURN_IF_ERROR(CheckDelayedUpdatePlacement());
  STRATA_RETURN_IF_ERROR(CheckRecheckPlacement());
  STRATA_RETURN_IF_ERROR(ReserveCollectiveBuffers());
  SpillStatesToNvme();
  STRATA_RETURN_IF_ERROR(AllocateHostBuffers());
  STRATA_RETURN_IF_ERROR(PlaceOnNvme());
  STRATA_RETURN_IF_ERROR(CreateNvmeStaging());
  AllocateStateShadows();
  STRATA_RETURN_IF_ERROR(WriteInitialValues(parameters));
  return StartParts();
}

Status Engine::Impl::JoinRanks() {
  if (environment_.communicator == nullptr) {
    environment_.communicator = CreateSingleRankCommunicator();
  }
  rank_ = environment_.communicator->rank();  // Create built the layout for its size.
  return CheckShardable();
}

Status Engine::Impl::CheckDeviceStatesBuilt() const {
  const PlacementOptions& place = options_.placement;
  // (EngineOptions::Validate refused device-kept states with offloaded parameters.)
  const bool wants_device_states =
      place.optimizer_states == Tier::kDevice || place.offload_ratio < 1.0;
  // The device passed decides, whatever options.device says: the CPU must not touch a GPU's
  // memory.
  return wants_device_states ? Updaters::CheckDeviceStatesServed(device_) : Status();
}

void Engine::Impl::LayOutChunks() {
  const size_t wsize = working_size();
  const PlacementOptions& place = options_.placement;
  chunks_ = std::vector<Chunk>(layout_.chunk_count());
  uint64_t params_in_host = 0;
  for (size_t i = 0; i < chunks_.size(); ++i) {
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
}

Status Engine::Impl::PlaceDeviceParams() {
  const size_t wsize = working_size();
  for (size_t i = 0; i < chunks_.size(); ++i) {
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
  return Status();
}

std::vector<size_t> Engine::Impl::TrainedChunks() const {
  std::vector<size_t> trained;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    if (!chunks_[i].frozen()) trained.push_back(i);
  }
  return trained;
}

Status Engine::Impl::PlaceDeviceStates() {
  const PlacementOptions& place = options_.placement;
  const int gas = options_.optimizer.gradient_accumulation_steps;
  const std::vector<size_t> trained = TrainedChunks();
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
  return Status();
}

void Engine::Impl::KeepStatesInHost() {
  // States homed on NVMe fill max_states_in_host first, in the same order: the chunks whose
  // gradients arrive last, with the least time left to read their states, read nothing. A
  // chunk too large for what is left (an embedding) goes to NVMe and the next ones still fill.
  uint64_t states_in_host = 0;
  for (size_t i : TrainedChunks()) {
    Chunk& c = chunks_[i];
    if (c.placement.optimizer_states != Tier::kNvme) continue;
    if (states_in_host + c.state_bytes() > options_.placement.max_states_in_host) continue;
    c.placement.optimizer_states = Tier::kHost;
    states_in_host += c.state_bytes();
  }
}

Status Engine::Impl::CheckFetchRoom() const {
  // Offloaded parameters fetch into whatever the device has left: it must hold any one chunk.
  if (options_.placement.params == Tier::kDevice) return Status();
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
  return Status();
}

Status Engine::Impl::ReserveCollectiveBuffers() {
  const PlacementOptions& place = options_.placement;
  // Stage 3's host slots that chunks' parameters are gathered into (for the chunk acquired and
  // the prefetch depth's), before spilling states or sizing staging: both fit what is left.
  if (std::any_of(chunks_.begin(), chunks_.end(),
                  [](const Chunk& c) { return c.params_sharded; })) {
    const size_t slots = size_t(std::max(0, place.prefetch_depth)) + 1;
    const size_t bytes = max_trained_numel() * working_size();
    const uint64_t total = slots * (AlignUp(bytes, kHostAlignment) +
                                    param_gather_.SlotExtraBytes(max_trained_shard_numel()));
    STRATA_RETURN_IF_ERROR(host_budget_.Reserve(
        total, "the " + std::to_string(slots) +
                   " buffers stage 3 gathers parameters into (placement.prefetch_depth + 1)"));
    static_reservations_.emplace_back(&host_budget_, total);
    STRATA_RETURN_IF_ERROR(param_gather_.Initialize(slots, bytes, max_trained_shard_numel()));
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
  return Status();
}

Status Engine::Impl::AllocateHostBuffers() {
  for (size_t i = 0; i < chunks_.size(); ++i) {
    for (const HostBuffer& b : HostBuffersOf(i)) {
      if (b.bytes == 0) continue;
      STRATA_RETURN_IF_ERROR(host_budget_.Reserve(
          AlignUp(b.bytes, kHostAlignment),
          b.what + " (set host.pinned_memory_bytes higher, or offload more to nvme)"));
      static_reservations_.emplace_back(&host_budget_, AlignUp(b.bytes, kHostAlignment));
      STRATA_ASSIGN_OR_RETURN(*b.buffer, AllocateZeroed(b.bytes));
    }
  }
  // Gradients land in, and new parameters leave from, pinned memory so device copies run at
  // full speed; host-home parameters are pinned too when host.pin_memory asks for it.
  if (!device_.CanPin()) return Status();
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
  return Status();
}

Status Engine::Impl::PlaceOnNvme() {
  const size_t wsize = working_size();
  uint64_t nvme_bytes = 0;
  for (const Chunk& c : chunks_) {
    if (c.placement.optimizer_states == Tier::kNvme)
      nvme_bytes += 2 * AlignUp(c.state_bytes(), kMiB);
    if (c.placement.params == Tier::kNvme) {
      nvme_bytes += 2 * AlignUp(c.param_home_bytes(wsize), kMiB);
    }
  }
  transactional_ = std::any_of(chunks_.begin(), chunks_.end(), [](const Chunk& c) {
    return c.placement.optimizer_states == Tier::kNvme || c.placement.params == Tier::kNvme;
  });
  if (nvme_bytes == 0) return Status();
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
  for (Chunk& c : chunks_) {
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
  return Status();
}

Status Engine::Impl::CreateNvmeStaging() {
  if (!swap_) return Status();  // Nothing on NVMe.
  auto make_pool = [&](size_t bytes, int count,
                       const char* what) -> Result<std::unique_ptr<StagingPool>> {
    const uint64_t total = StagingPoolBytes(bytes, count);
    STRATA_RETURN_IF_ERROR(host_budget_.Reserve(total, what));
    static_reservations_.emplace_back(&host_budget_, total);
    return StagingPool::Create(
        {.buffer_bytes = bytes, .buffer_count = size_t(count), .pin_with = &device_});
  };
  const size_t nvme_chunks = size_t(std::count_if(chunks_.begin(), chunks_.end(), [](auto& c) {
    return c.placement.optimizer_states == Tier::kNvme;
  }));
  const bool nvme_params = std::any_of(chunks_.begin(), chunks_.end(), [](const Chunk& c) {
    return c.placement.params == Tier::kNvme;
  });
  // Parameter staging first: automatic state staging takes what the budget has left.
  if (nvme_params) {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<StagingPool> pool,
                            make_pool(max_nvme_param_bytes(), options_.host.param_buffer_count,
                                      "the parameter staging buffers"));
    param_staging_.emplace(std::move(pool));
  }
  if (nvme_chunks == 0) return Status();
  // The read-ahead of the states (StatePreloader) gets its pool here.
  const size_t bytes = ChunkStateBytes(max_nvme_state_numel());
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
  return Status();
}

Status Engine::Impl::WriteInitialValues(std::span<const ParameterSpec> parameters) {
  // Master = given values (padding zero), moments zero; a frozen chunk's "states" are just the
  // values (Chunk::state_bytes). With several ranks, the states hold this rank's shard of the
  // master, and the working parameters come from the whole of it.
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer states, AlignedBuffer::Allocate(max_state_bytes()));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer whole,
                          AlignedBuffer::Allocate(layout_.max_chunk_numel() * sizeof(float)));
  for (size_t i = 0; i < chunks_.size(); ++i) {
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
  return Status();
}

Status Engine::Impl::StartParts() {
  STRATA_ASSIGN_OR_RETURN(compute_marker_, device_.CreateEvent());
  STRATA_RETURN_IF_ERROR(
      residency_.Initialize(param_staging_ ? &*param_staging_ : nullptr, swap_.get(), zeros_));
  STRATA_ASSIGN_OR_RETURN(cpu_adam::CpuOptimizer optimizer,
                          cpu_adam::CpuOptimizer::Create(
                              {.threads = OptimizerThreads(options_, environment_.ranks_on_node)}));
  optimizer_.emplace(std::move(optimizer));
  STRATA_ASSIGN_OR_RETURN(Updaters updaters,
                          Updaters::Create({.device = device_, .cpu = *optimizer_}));
  updaters_.emplace(std::move(updaters));
  param_gather_.Connect(*environment_.communicator, swap_.get(), *optimizer_);
  m_.Register(metrics_);
  m_.loss_scale->Set(pipeline_.loss_scale());
  UpdateTierGauges();
  pipeline_.Initialize();
  return Status();
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

Status Engine::Impl::CheckRecheckPlacement() const {
  const OptimizerOptions& o = options_.optimizer;
  if (!o.recheck_gradients) return Status();
  // Step() reads each chunk's gradients again where the trainer keeps them, on the CPU.
  if (!device_.properties().host_accessible) {
    return Unavailable(
        "optimizer.recheck_gradients reads the trainer's gradient buffers on the CPU at Step(); "
        "on " +
        device_.properties().name +
        " that is not built yet (it needs a device kernel): leave it off and hand the gradients "
        "over only when they are final");
  }
  if (sharded()) {
    return Unavailable("optimizer.recheck_gradients across several ranks is not built yet");
  }
  if (o.gradient_accumulation_steps != 1) {
    return InvalidArgument(
        "optimizer.recheck_gradients needs gradient_accumulation_steps 1 (the trainer sums its "
        "micro-steps and declares the sum once), got " +
        std::to_string(o.gradient_accumulation_steps));
  }
  if (o.delayed_update) {
    return InvalidArgument(
        "optimizer.recheck_gradients and optimizer.delayed_update exclude each other: a delayed "
        "step has left Step() before its gradients could be read again");
  }
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    if (!c.frozen() && c.placement.params != Tier::kDevice) {
      return InvalidArgument(
          "optimizer.recheck_gradients needs the trained parameters on the device (their "
          "gradient buffers stay where the trainer keeps them), but chunk " +
          std::to_string(i) + "'s live in " + std::string(TierName(c.placement.params)) +
          " memory; set placement.params to device");
    }
  }
  return Status();
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

}  // namespace strata::offload
