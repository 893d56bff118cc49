#include "strata/offload/pipeline_benchmark.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include "engine/host_memory.h"
#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"
#include "strata/core/host_device.h"
#include "strata/core/staging_pool.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_space.h"
#include "strata/offload/engine.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// Queues `ms` milliseconds of "device compute" on the compute stream.
Status QueueCompute(Device& device, double ms) {
  return device.LaunchHostFunction(Stream::kCompute, [ms] {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
  });
}

/// Chunks whose working parameters and gradients the device has room for: all of them, or with
/// parameters offloaded, the one in use, the prefetched ones and one being evicted.
int DeviceChunkSlots(const PipelineBenchmarkOptions& o) {
  if (o.params == Tier::kDevice) return o.chunks + 1;
  return std::min(o.chunks, EngineOptions().placement.prefetch_depth + 2);
}

/// Device memory: DeviceChunkSlots chunks' parameters and gradients.
uint64_t DeviceBytes(const PipelineBenchmarkOptions& o) {
  return 2 * o.chunk_bytes * uint64_t(DeviceChunkSlots(o)) + kMiB;
}

/// HostDevice with DeviceBytes of memory, copies at copy_gbps.
Result<std::unique_ptr<Device>> CreateBenchmarkDevice(const PipelineBenchmarkOptions& o) {
  return CreateHostDevice(
      {.memory_budget_bytes = DeviceBytes(o), .copy_bytes_per_second = o.copy_gbps * 1e9});
}

/// The engine's host budget: the automatic one, less the device's memory, which on HostDevice
/// comes out of the same RAM (a GPU's would not): otherwise automatic staging could fill the
/// budget on top of a large model's "device" memory and run the machine out of memory.
uint64_t EngineHostBudget(const PipelineBenchmarkOptions& o) {
  const uint64_t automatic = HostBudgetBytes(EngineOptions());
  return automatic - std::min(automatic / 2, DeviceBytes(o));
}

/// Host->device copies a step makes of each chunk: the upload of its updated parameters, or with
/// parameters offloaded, a fetch for forward and another for backward (the updated parameters
/// stay home until the next forward fetches them).
int UploadsPerChunk(const PipelineBenchmarkOptions& o) { return o.params == Tier::kDevice ? 1 : 2; }

/// Forward and backward of every chunk, alone on the compute stream.
Result<double> TimeCompute(Device& device, const PipelineBenchmarkOptions& o) {
  const auto start = Clock::now();
  for (int c = 0; c < o.chunks; ++c) STRATA_RETURN_IF_ERROR(QueueCompute(device, o.forward_ms));
  for (int c = 0; c < o.chunks; ++c) STRATA_RETURN_IF_ERROR(QueueCompute(device, o.backward_ms));
  STRATA_RETURN_IF_ERROR(device.SynchronizeStream(Stream::kCompute));
  return SecondsSince(start);
}

/// One chunk's working bytes `per_chunk` times per chunk in one direction, alone on its stream.
Result<double> TimeCopies(Device& device, const PipelineBenchmarkOptions& o, bool to_device,
                          int per_chunk) {
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer on_device, device.Allocate(o.chunk_bytes));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer on_host, AlignedBuffer::Allocate(o.chunk_bytes));
  std::memset(on_host.data(), 0, on_host.size());
  const Stream stream = to_device ? Stream::kHostToDevice : Stream::kDeviceToHost;
  const auto start = Clock::now();
  for (int c = 0; c < o.chunks * per_chunk; ++c) {
    STRATA_RETURN_IF_ERROR(
        to_device ? device.CopyToDevice(on_device.data(), on_host.data(), o.chunk_bytes)
                  : device.CopyToHost(on_host.data(), on_device.data(), o.chunk_bytes));
  }
  STRATA_RETURN_IF_ERROR(device.SynchronizeStream(stream));
  return SecondsSince(start);
}

/// Distinct chunks' arrays the CPU optimizer reference steps in turn: enough for 256 MiB, far
/// beyond any cache, so reusing them flatters nothing, and a model larger than memory can be
/// timed. Every chunk of the model is still stepped.
int AdamReferenceChunks(const PipelineBenchmarkOptions& o, size_t numel) {
  const uint64_t per_chunk = ChunkStateBytes(numel) + 2 * o.chunk_bytes;
  return int(std::min<uint64_t>(uint64_t(o.chunks), (256 * kMiB + per_chunk - 1) / per_chunk));
}

/// The optimizer step of every chunk, alone, on arrays laid out as the engine's.
Result<double> TimeCpuAdam(const PipelineBenchmarkOptions& o, size_t numel) {
  STRATA_ASSIGN_OR_RETURN(cpu_adam::CpuOptimizer optimizer,
                          cpu_adam::CpuOptimizer::Create({.threads = o.threads}));
  const size_t wsize = DTypeSize(o.working_dtype);
  const int distinct = AdamReferenceChunks(o, numel);
  std::vector<AlignedBuffer> states, grads, copies;
  for (int c = 0; c < distinct; ++c) {
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer s, AlignedBuffer::Allocate(ChunkStateBytes(numel)));
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer g, AlignedBuffer::Allocate(numel * wsize));
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer p, AlignedBuffer::Allocate(numel * wsize));
    // First touch by the optimizer's threads, as in the engine's steady state.
    STRATA_RETURN_IF_ERROR(optimizer.Fill(s.data(), DType::kFp32, 3 * numel, 0.0f));
    STRATA_RETURN_IF_ERROR(optimizer.Fill(g.data(), o.working_dtype, numel, 0.0f));
    STRATA_RETURN_IF_ERROR(optimizer.Fill(p.data(), o.working_dtype, numel, 0.0f));
    states.push_back(std::move(s));
    grads.push_back(std::move(g));
    copies.push_back(std::move(p));
  }
  auto step_all = [&](int64_t step) -> Status {
    for (int chunk = 0; chunk < o.chunks; ++chunk) {
      const int c = chunk % distinct;
      float* s = reinterpret_cast<float*>(states[c].data());
      STRATA_RETURN_IF_ERROR(optimizer.Step(
          cpu_adam::AdamWHyperParams{.step = step},
          cpu_adam::StepBuffers{
              .numel = numel,
              .params = s,
              .grads = grads[c].data(),
              .grad_dtype = o.working_dtype,
              .exp_avg = s + numel,
              .exp_avg_sq = s + 2 * numel,
              .param_copy = o.working_dtype == DType::kFp32 ? nullptr : copies[c].data(),
              .param_copy_dtype =
                  o.working_dtype == DType::kFp32 ? DType::kBf16 : o.working_dtype}));
    }
    return Status();
  };
  STRATA_RETURN_IF_ERROR(step_all(1));  // Warm-up.
  const auto start = Clock::now();
  STRATA_RETURN_IF_ERROR(step_all(2));
  return SecondsSince(start);
}

/// Chunks whose states the engine keeps on NVMe: those past max_states_in_host.
int NvmeStateChunks(const PipelineBenchmarkOptions& o, size_t numel) {
  const uint64_t in_host = o.max_states_in_host / ChunkStateBytes(numel);
  return o.chunks - int(std::min<uint64_t>(in_host, uint64_t(o.chunks)));
}

/// The state staging buffers the engine takes for this model: Engine::Create's rule
/// (host_memory.h) on the host memory its other buffers leave (Engine::Impl::HostBuffersOf for
/// these chunks: gradients landing, the updated parameters, the parameters' home on host, the
/// delayed update's copy, the states kept in host memory).
int EngineStateBuffers(const PipelineBenchmarkOptions& o, size_t numel, int nvme_chunks) {
  EngineOptions options;
  options.host.optimizer_buffer_count = o.state_buffers;
  const uint64_t chunk = AlignUp(o.chunk_bytes, kHostAlignment);
  const uint64_t states = AlignUp(ChunkStateBytes(numel), kHostAlignment);
  const int host_kept = o.chunks - nvme_chunks;
  const uint64_t per_chunk =
      chunk * (2 + (o.params == Tier::kHost ? 1 : 0) + (o.delayed_update ? 1 : 0));
  const uint64_t used = per_chunk * uint64_t(o.chunks) + states * uint64_t(host_kept);
  const uint64_t budget = EngineHostBudget(o);
  const uint64_t free = budget - std::min(budget, used);
  const bool gated = o.gradient_clipping > 0 || o.working_dtype == DType::kFp16;
  uint64_t speculation = 0;
  if (gated && o.speculative_updates) {
    speculation = states * uint64_t(host_kept) +
                  (o.params == Tier::kDevice ? chunk * uint64_t(nvme_chunks) : 0);
  }
  return StateBufferCount(options.host, size_t(nvme_chunks), states,
                          StateStagingRoom(free, speculation));
}

/// Reads, then writes, `chunks` chunks' optimizer states through a swap space, with as many in
/// flight as the engine has staging buffers; with o.nvme_working_set_chunks, as rounds over that
/// many chunks' extents, a read pass then a write pass each, as the engine's steps run them.
/// Returns {read seconds, write seconds} for all `chunks` chunks' worth.
Result<std::pair<double, double>> TimeNvme(const PipelineBenchmarkOptions& o, size_t numel,
                                           int chunks) {
  const int distinct =
      o.nvme_working_set_chunks > 0 ? std::min(o.nvme_working_set_chunks, chunks) : chunks;
  const int rounds = (chunks + distinct - 1) / distinct;
  const NvmeOptions nv;
  STRATA_ASSIGN_OR_RETURN(auto io,
                          nvme::IoEngine::Create({.backend = nv.backend,
                                                  .block_size = nv.block_size,
                                                  .queue_depth = uint32_t(nv.queue_depth)}));
  const uint64_t bytes = ChunkStateBytes(numel);
  const uint64_t per_path =
      AlignUp(AlignUp(bytes, kMiB) * distinct / o.nvme_paths.size() + 16 * kMiB, kMiB);
  STRATA_ASSIGN_OR_RETURN(
      auto swap,
      nvme::SwapSpace::Create(
          {.paths = o.nvme_paths, .bytes_per_path = per_path, .checksums = nv.checksums}, *io));
  // The engine's staging buffers: same count, size and registration, so the same I/O path.
  const int in_flight = std::min(distinct, EngineStateBuffers(o, numel, chunks));
  STRATA_ASSIGN_OR_RETURN(auto staging, StagingPool::Create({.buffer_bytes = bytes,
                                                             .buffer_count = size_t(in_flight)}));
  const bool registered = io->RegisterBuffers(staging->arena(), staging->buffer_bytes());
  std::vector<StagingBuffer> buffers;
  for (int i = 0; i < in_flight; ++i) {
    buffers.push_back(staging->Acquire());
    std::memset(buffers.back().data(), 0x3c, buffers.back().size());
  }
  std::vector<nvme::ExtentId> extents;
  for (int c = 0; c < distinct; ++c) {
    STRATA_ASSIGN_OR_RETURN(nvme::ExtentId e, swap->Allocate(bytes));
    extents.push_back(e);
  }
  // Runs read or write over all extents, `in_flight` at a time, each completion starting the
  // next.
  auto pass = [&](bool write) -> Result<double> {
    std::mutex mutex;
    std::condition_variable done_cv;
    int next = 0, done = 0;
    Status failure;
    std::function<void(int)> start_one = [&](int slot) {
      int chunk;
      {
        std::lock_guard lock(mutex);
        if (next >= distinct) return;
        chunk = next++;
      }
      auto finished = [&, slot](Status s) {
        start_one(slot);  // Before counting this one done: the waiter may return right after.
        std::lock_guard lock(mutex);
        ++done;
        if (!s.ok() && failure.ok()) failure = s;
        done_cv.notify_all();
      };
      const int fixed = registered ? int(buffers[slot].index()) : -1;
      if (write) {
        swap->Write(extents[chunk], buffers[slot].data(), bytes, fixed, finished);
      } else {
        swap->Read(extents[chunk], buffers[slot].data(), fixed, finished);
      }
    };
    const auto start = Clock::now();
    for (int slot = 0; slot < in_flight; ++slot) start_one(slot);
    std::unique_lock lock(mutex);
    done_cv.wait(lock, [&] { return done == distinct; });
    if (!failure.ok()) return failure;
    return SecondsSince(start);
  };
  STRATA_RETURN_IF_ERROR(pass(/*write=*/true).status());  // Lays the extents out, unmeasured.
  double read_seconds = 0.0, write_seconds = 0.0;
  for (int round = 0; round < rounds; ++round) {
    STRATA_ASSIGN_OR_RETURN(const double read, pass(/*write=*/false));
    STRATA_ASSIGN_OR_RETURN(const double written, pass(/*write=*/true));
    read_seconds += read;
    write_seconds += written;
  }
  for (nvme::ExtentId e : extents) swap->Free(e);
  // Scaled to `chunks` chunks' worth (the last round may pass the count).
  const double share = double(chunks) / double(rounds * distinct);
  return std::make_pair(read_seconds * share, write_seconds * share);
}

/// With clip_triggered: gives chunk 0's gradient buffer (backward produces it last) one value
/// whose norm, unscaled, is twice the clipping threshold, once (backward of the synthetic model
/// writes nothing, so the buffer keeps it). Every other chunk's gradients stay zero, so each of
/// them updates ahead of the verdict and is rolled back when chunk 0 lands: the worst case.
Status FillGradients(Engine& engine, Device& device, const PipelineBenchmarkOptions& o) {
  if (!o.clip_triggered) return Status();
  STRATA_ASSIGN_OR_RETURN(ChunkView view, engine.Acquire(0));
  const float value =
      float(2.0 * o.gradient_clipping / std::sqrt(double(view.numel)) * engine.loss_scale());
  std::vector<float> values(view.numel, value);
  std::vector<std::byte> stored(view.numel * DTypeSize(view.dtype));
  Fp32ToDType(values, view.dtype, stored.data());
  Status copied = device.CopyToDevice(view.grads, stored.data(), stored.size());
  if (copied.ok()) copied = device.SynchronizeStream(Stream::kHostToDevice);
  engine.Release(0);
  return copied;
}

/// One training step of the synthetic model through the engine: its seconds and report. With
/// delayed updates, `running` carries the step left updating from one call to the next: each
/// call completes the step before it (whose report it returns) and leaves its own running, so
/// its time is one step's share of the overlap.
Result<std::pair<double, StepReport>> TimeEngineStep(
    Engine& engine, Device& device, const PipelineBenchmarkOptions& o,
    std::optional<std::future<Result<StepReport>>>& running) {
  const auto start = Clock::now();
  for (size_t c = 0; c < engine.chunk_count(); ++c) {
    STRATA_RETURN_IF_ERROR(engine.Acquire(c).status());
    STRATA_RETURN_IF_ERROR(QueueCompute(device, o.forward_ms));
    engine.Release(c);
  }
  for (size_t c = engine.chunk_count(); c-- > 0;) {
    STRATA_RETURN_IF_ERROR(engine.Acquire(c).status());
    STRATA_RETURN_IF_ERROR(QueueCompute(device, o.backward_ms));
    STRATA_RETURN_IF_ERROR(engine.GradsReady(c));
    engine.Release(c);
  }
  std::future<Result<StepReport>> step = engine.Step();
  if (o.delayed_update) {
    if (!running) {  // The first step: nothing before it to complete.
      running = std::move(step);
      return std::make_pair(SecondsSince(start), StepReport{});
    }
    std::swap(*running, step);  // `step` is now the one before.
  }
  STRATA_ASSIGN_OR_RETURN(StepReport report, step.get());
  return std::make_pair(SecondsSince(start), report);
}

}  // namespace

Status PipelineBenchmarkOptions::Validate() const {
  if (chunks < 1 || chunks > 100000) {
    return InvalidArgument("--chunks must be in [1, 100000], got " + std::to_string(chunks));
  }
  if (chunk_bytes == 0 || chunk_bytes % 4096 != 0) {
    return InvalidArgument("--chunk-size must be a positive multiple of 4KiB, got " +
                           std::to_string(chunk_bytes));
  }
  if (forward_ms < 0 || backward_ms < 0 || forward_ms > 60000 || backward_ms > 60000) {
    return InvalidArgument("--forward-ms and --backward-ms must be in [0, 60000]");
  }
  if (copy_gbps < 0) return InvalidArgument("--copy-gbps must be >= 0");
  if (params != Tier::kDevice && params != Tier::kHost) {
    return InvalidArgument("--offload-param must be device or host");
  }
  if (params != Tier::kDevice && delayed_update) {
    return InvalidArgument("--delayed-update needs the parameters on the device");
  }
  if (optimizer_states != Tier::kHost && optimizer_states != Tier::kNvme) {
    return InvalidArgument("--offload-optimizer must be host or nvme");
  }
  if (optimizer_states == Tier::kNvme && nvme_paths.empty()) {
    return InvalidArgument("--offload-optimizer nvme needs --nvme-path DIR");
  }
  if (state_buffers < 0 || state_buffers > 4096) {
    return InvalidArgument("--state-buffers must be in [0, 4096]");
  }
  if (max_states_in_host > 0 && optimizer_states != Tier::kNvme) {
    return InvalidArgument("--max-states-in-host needs --offload-optimizer nvme");
  }
  if (!std::isfinite(gradient_clipping) || gradient_clipping < 0) {
    return InvalidArgument("--gradient-clipping must be a finite number >= 0");
  }
  if (clip_triggered && gradient_clipping == 0) {
    return InvalidArgument("--clip-triggered needs --gradient-clipping X > 0");
  }
  if (warmup_steps < 0 || timed_steps < 1) {
    return InvalidArgument("--warmup must be >= 0 and --steps >= 1");
  }
  return Status();
}

Result<std::vector<ResourceTime>> TimeResourcesAlone(const PipelineBenchmarkOptions& o) {
  STRATA_RETURN_IF_ERROR(o.Validate());
  auto say = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };
  const size_t numel = o.chunk_bytes / DTypeSize(o.working_dtype);
  STRATA_ASSIGN_OR_RETURN(auto device, CreateBenchmarkDevice(o));
  const uint64_t chunk_copy_bytes = o.chunk_bytes * o.chunks;
  std::vector<ResourceTime> resources;
  say("compute alone");
  STRATA_ASSIGN_OR_RETURN(double compute, TimeCompute(*device, o));
  resources.push_back({"compute", compute, 0});
  say("device->host copies alone");
  STRATA_ASSIGN_OR_RETURN(double d2h, TimeCopies(*device, o, /*to_device=*/false, 1));
  resources.push_back({"device_to_host", d2h, chunk_copy_bytes});
  say("cpu adam alone");
  STRATA_ASSIGN_OR_RETURN(double adam, TimeCpuAdam(o, numel));
  resources.push_back({"cpu_adam", adam, uint64_t(28) * numel * o.chunks});
  if (const int nvme_chunks = NvmeStateChunks(o, numel);
      o.optimizer_states == Tier::kNvme && nvme_chunks > 0) {
    say("nvme reads and writes alone");
    STRATA_ASSIGN_OR_RETURN(auto nvme, TimeNvme(o, numel, nvme_chunks));
    resources.push_back({"nvme_read", nvme.first, ChunkStateBytes(numel) * nvme_chunks});
    resources.push_back({"nvme_write", nvme.second, ChunkStateBytes(numel) * nvme_chunks});
  }
  say("host->device copies alone");
  STRATA_ASSIGN_OR_RETURN(double h2d,
                          TimeCopies(*device, o, /*to_device=*/true, UploadsPerChunk(o)));
  resources.push_back({"host_to_device", h2d, chunk_copy_bytes * UploadsPerChunk(o)});
  return resources;
}

namespace {

/// The engine's steps of the synthetic model, into `result` (step times, roll-backs, memory).
Status TimeEngineSteps(const PipelineBenchmarkOptions& o, PipelineBenchmarkResult& result) {
  auto say = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };
  const size_t numel = o.chunk_bytes / DTypeSize(o.working_dtype);
  EngineOptions options;
  options.precision.working_dtype = o.working_dtype;
  options.placement.optimizer_states = o.optimizer_states;
  options.placement.params = o.params;
  options.placement.chunk_bytes = o.chunk_bytes;
  options.optimizer.cpu_threads = o.threads;
  options.host.optimizer_buffer_count = o.state_buffers;
  options.host.pinned_memory_bytes = EngineHostBudget(o);
  options.optimizer.gradient_clipping = o.gradient_clipping;
  options.optimizer.speculative_updates = o.speculative_updates;
  options.optimizer.delayed_update = o.delayed_update;
  options.optimizer.delayed_update_from_step = 0;
  // NVMe only where the states are asked to be: states on host must not spill there unseen.
  if (o.optimizer_states == Tier::kNvme) options.nvme.paths = o.nvme_paths;
  options.placement.max_states_in_host = o.max_states_in_host;
  std::vector<ParameterSpec> specs;
  for (int c = 0; c < o.chunks; ++c) {
    specs.push_back({"chunk" + std::to_string(c) + ".weight", {int64_t(numel)}, {}});
  }
  STRATA_ASSIGN_OR_RETURN(auto device, CreateBenchmarkDevice(o));
  STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(options, *device, specs));
  STRATA_RETURN_IF_ERROR(FillGradients(*engine, *device, o));
  std::optional<std::future<Result<StepReport>>> running;
  for (int s = 0; s < o.warmup_steps + o.timed_steps; ++s) {
    const bool timed = s >= o.warmup_steps;
    say(timed ? "engine step " + std::to_string(s - o.warmup_steps + 1) + "/" +
                    std::to_string(o.timed_steps)
              : "engine warm-up step " + std::to_string(s + 1));
    STRATA_ASSIGN_OR_RETURN(auto step, TimeEngineStep(*engine, *device, o, running));
    if (timed) {
      result.step_seconds.push_back(step.first);
      result.rolled_back_steps += step.second.rolled_back ? 1 : 0;
    }
  }
  if (running) STRATA_RETURN_IF_ERROR(running->get().status());
  const TierUsage host = engine->tier_usage(Tier::kHost);
  result.host_budget_bytes = host.budget_bytes;
  result.host_peak_bytes = host.peak_bytes;
  return Status();
}

}  // namespace

Result<PipelineBenchmarkResult> RunPipelineBenchmark(const PipelineBenchmarkOptions& o) {
  PipelineBenchmarkResult result;
  STRATA_ASSIGN_OR_RETURN(result.resources, TimeResourcesAlone(o));
  const size_t numel = o.chunk_bytes / DTypeSize(o.working_dtype);
  result.params = uint64_t(numel) * o.chunks;
  STRATA_RETURN_IF_ERROR(TimeEngineSteps(o, result));

  // The drives' speed drifts over minutes (a virtual disk's more than most): NVMe alone is timed
  // again after the steps (the engine gone, its files with it), and the reference is the mean.
  if (const int nvme_chunks = NvmeStateChunks(o, numel);
      o.optimizer_states == Tier::kNvme && nvme_chunks > 0) {
    if (o.progress) o.progress("nvme reads and writes alone, again");
    STRATA_ASSIGN_OR_RETURN(auto after, TimeNvme(o, numel, nvme_chunks));
    for (ResourceTime& r : result.resources) {
      if (r.name == "nvme_read") {
        result.nvme_before_seconds += r.seconds;
        r.seconds = (r.seconds + after.first) / 2;
      } else if (r.name == "nvme_write") {
        result.nvme_before_seconds += r.seconds;
        r.seconds = (r.seconds + after.second) / 2;
      }
    }
    result.nvme_after_seconds = after.first + after.second;
  }

  double nvme_seconds = 0.0;
  for (const ResourceTime& r : result.resources) {
    result.serial_seconds += r.seconds;
    if (r.name == "nvme_read" || r.name == "nvme_write") {
      nvme_seconds += r.seconds;
      continue;
    }
    if (r.seconds > result.slowest_seconds) {
      result.slowest = r.name;
      result.slowest_seconds = r.seconds;
    }
  }
  if (nvme_seconds > result.slowest_seconds) {
    result.slowest = "nvme";
    result.slowest_seconds = nvme_seconds;
  }
  result.physical_memory_bytes = PhysicalMemoryBytes();
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0) result.peak_rss_bytes = uint64_t(usage.ru_maxrss) * 1024;
  std::vector<double> sorted = result.step_seconds;
  std::sort(sorted.begin(), sorted.end());
  result.step_median_seconds = sorted[sorted.size() / 2];
  result.ratio_to_slowest = result.step_median_seconds / result.slowest_seconds;
  result.ratio_to_serial = result.step_median_seconds / result.serial_seconds;
  return result;
}

}  // namespace strata::offload
