// The step pipeline benchmark behind `strata bench pipeline`: does a training step cost what its
// slowest resource costs, or the sum of all of them?
//
// A synthetic model runs on HostDevice: `chunks` chunks of `chunk_bytes` working parameters,
// whose forward and backward are sleeps on the device's compute stream (a GPU computing while
// the CPU is free), with host<->device copies throttled to `copy_gbps`. Each resource is first
// timed alone on exactly the bytes and work a step gives it (compute, both copy directions, the
// CPU optimizer, NVMe reads and writes of the optimizer states), then full engine steps are
// timed. PERFORMANCE.md's targets: step / slowest resource <= 1.10 with states on host, <= 1.15
// on NVMe.
//
// The NVMe reads and writes of a step share the same drives, so the "nvme" resource is their sum;
// both are reported separately too, each the mean of a timing before the engine steps and one
// after them (drives drift). HostDevice's memory is host RAM, so the engine's automatic
// host budget is taken less the device's memory.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/core/tier.h"

namespace strata::offload {

struct PipelineBenchmarkOptions {
  /// Chunks of the synthetic model, >= 1.
  int chunks = 16;
  /// Working parameters per chunk, in bytes of `working_dtype` (a multiple of 4 KiB).
  uint64_t chunk_bytes = 8 << 20;
  DType working_dtype = DType::kBf16;
  /// Device compute per chunk, forward and backward, in milliseconds (>= 0).
  double forward_ms = 5.0;
  double backward_ms = 10.0;
  /// Host<->device copy bandwidth (each direction), GB/s; 0 = unthrottled memcpy.
  double copy_gbps = 4.0;
  /// Home of the optimizer states: host or nvme.
  Tier optimizer_states = Tier::kHost;
  /// Home of the working parameters: device, or host (DeepSpeed offload_param cpu), in which
  /// case the device holds prefetch_depth + 2 chunks and forward and backward each fetch every
  /// chunk. On HostDevice the device's memory is host memory too: a model whose states exceed
  /// the machine's memory leaves no room for its working parameters and gradients "on the
  /// device" unless they are offloaded as well, as ZeRO-Infinity does for such a model.
  Tier params = Tier::kDevice;
  /// NVMe directories (required for nvme).
  std::vector<std::string> nvme_paths;
  /// With states on nvme: this many bytes of them (whole chunks, the first) in host memory
  /// instead (placement.max_states_in_host); NVMe alone is then timed on the rest.
  uint64_t max_states_in_host = 0;
  /// host.optimizer_buffer_count: staging buffers for the states on NVMe; 0 = automatic. The
  /// NVMe reference runs with as many in flight.
  int state_buffers = 0;
  /// TimeResourcesAlone's NVMe reference cycles through the states of this many chunks (0 or
  /// more than there are: all of them), reading and then writing them round after round until
  /// every NVMe chunk's worth has moved each way: a small model's own working set (which a
  /// drive's or a virtual disk's cache may hold) timed over enough traffic to be steady.
  int nvme_working_set_chunks = 0;
  /// Clip gradients to this global norm (OptimizerOptions::gradient_clipping); 0 = off. The
  /// synthetic model's gradients are zero, so this alone never clips: it measures a gated step
  /// whose verdict agrees with the speculation.
  double gradient_clipping = 0.0;
  /// Gives the gradients of the chunk backward reaches last a norm of twice gradient_clipping
  /// (which must be set), the others none, so that every step clips only once the last
  /// gradients land: the worst case, in which every update made ahead of the verdict is rolled
  /// back and done again.
  bool clip_triggered = false;
  /// OptimizerOptions::speculative_updates: false makes gated steps wait for the norm.
  bool speculative_updates = true;
  /// OptimizerOptions::delayed_update from the first step: each step's update runs beside the
  /// next step's forward and backward (the step time is then one step's share of the overlap).
  bool delayed_update = false;
  /// CPU optimizer threads, 0 = all.
  int threads = 0;
  int warmup_steps = 2;
  int timed_steps = 5;
  /// Called with a short line before each phase (progress output); may be empty.
  std::function<void(const std::string&)> progress;

  Status Validate() const;
};

/// One resource timed alone.
struct ResourceTime {
  std::string name;  ///< "compute", "host_to_device", "device_to_host", "cpu_adam", ...
  double seconds = 0.0;
  uint64_t bytes = 0;  ///< Bytes it moved (0 for compute).
};

struct PipelineBenchmarkResult {
  std::vector<ResourceTime> resources;  ///< Each alone, in pipeline order.
  std::string slowest;                  ///< Name of the slowest resource (nvme = read + write).
  double slowest_seconds = 0.0;
  double serial_seconds = 0.0;       ///< Sum of all resources: a step with no overlap.
  std::vector<double> step_seconds;  ///< Each timed engine step.
  double step_median_seconds = 0.0;
  double ratio_to_slowest = 0.0;  ///< step_median / slowest (target <= 1.10 / 1.15).
  double ratio_to_serial = 0.0;   ///< step_median / serial.
  int rolled_back_steps = 0;      ///< Timed steps whose speculative updates were rolled back.
  /// NVMe alone (read + write), timed before the engine steps and again after them: the drives'
  /// speed drifts, so the nvme resources are the mean of the two. 0 without NVMe.
  double nvme_before_seconds = 0.0;
  double nvme_after_seconds = 0.0;
  uint64_t params = 0;  ///< Parameters of the synthetic model.
  /// The engine's host memory budget and the most of it in use during the engine steps.
  uint64_t host_budget_bytes = 0;
  uint64_t host_peak_bytes = 0;
  /// The process's peak resident memory over the whole run (references included), and the
  /// machine's physical memory, to show a model larger than memory never came near it.
  uint64_t peak_rss_bytes = 0;
  uint64_t physical_memory_bytes = 0;
};

/// Each resource timed alone on the bytes and work a step gives it, in pipeline order (the
/// first phase of RunPipelineBenchmark; no engine step runs). Errors as RunPipelineBenchmark.
Result<std::vector<ResourceTime>> TimeResourcesAlone(const PipelineBenchmarkOptions& options);

/// Runs the benchmark. Errors: InvalidArgument for bad options; whatever the engine or the NVMe
/// path reports otherwise.
Result<PipelineBenchmarkResult> RunPipelineBenchmark(const PipelineBenchmarkOptions& options);

}  // namespace strata::offload
