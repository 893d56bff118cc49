// StepPlan: how long a training step takes in each placement of `strata plan`, bounded by the
// resource it uses most, and which placement to pick for a machine's memory and bandwidths.
//
// Each resource's time per step is the bytes (or parameters) the placement gives it over its
// rate. The engine overlaps them the way its pipelines allow:
//
//   step = forward + max(backward, update) + commit     (no resource longer than the step)
//
// - forward and backward take a third and two thirds of the model's compute (backward does
//   twice forward's FLOPs). Offloaded parameters are fetched during both, half the traffic
//   each, so a phase lasts as long as its compute or its fetches, whichever is longer; the
//   data-parallel collectives are spread over them the same way.
// - update is the gradient -> optimizer -> parameter pipeline of offloaded optimizer states:
//   gradients to the host, the CPU optimizer, NVMe reads and writes of the states, the new
//   parameters back. It runs chunk by chunk, its stages overlapping, so it costs its slowest
//   stage; it starts as soon as backward produces the first gradients, so backward hides it.
//   Reads and writes of the same drives add up, backward's parameter reads included. The
//   state reads run ahead of backward, as far as the staging buffers reach (by default one per
//   NVMe-state chunk, within a quarter of the free host memory: host_memory.h), so up to
//   forward's length of them leaves the update; PlanInput::chunk_bytes says how many chunks
//   there are to buffer. States kept on the GPU cost no update time.
// - a gated step (fp16, whose overflow check needs every gradient, or gradient clipping, which
//   needs the global norm) updates during backward all the same, speculatively (as if it will
//   neither clip nor overflow; OptimizerOptions::speculative_updates), so it costs what an
//   ungated step costs: host-kept states are updated out of place into a second buffer, which
//   moves the same bytes. The model is of the common step, whose verdict keeps the updates; a
//   step that clips redoes them after backward. It assumes the host budget has room for the
//   second buffers (the engine takes them from what is left; chunks without one wait). Without
//   speculation no update starts before backward ends: update follows backward.
// - a delayed parameter update (OptimizerOptions::delayed_update) runs each step's update beside
//   the next step's forward and backward, which use parameters one update old: the update then
//   has the whole step, step = max(forward + backward, update) + commit.
// - commit: flipping NVMe shadow extents and bookkeeping, no transfer: the new working
//   parameters of device-home chunks go up in the pipeline, each as its update completes (a
//   failed step that leaves some new is finished by its retry, which does not redo them).
//
// Rates are what the engine achieves, not device peaks: NVMe bandwidth at the engine's chunk
// sizes and staging concurrency (`strata plan --measure` times the engine's own swap space and
// staging buffers), which can be well below a sequential benchmark's. Host memory and NVMe are
// the node's, shared by its GPUs; host<->device links are per GPU. A resource whose rate is
// unknown is left out, so the step time is then a lower bound (`unknown` names what is missing).
#pragma once

#include <string>
#include <vector>

#include "strata/offload/memory_plan.h"

namespace strata::offload {

/// A machine's rates; 0 = unknown (the resource is then left out and named in `unknown`).
struct MachineRates {
  double host_to_device_bytes_per_second = 0.0;  ///< Per GPU.
  double device_to_host_bytes_per_second = 0.0;  ///< Per GPU.
  double nvme_read_bytes_per_second = 0.0;       ///< The node's drives.
  double nvme_write_bytes_per_second = 0.0;
  double optimizer_params_per_second = 0.0;  ///< The node's CPU optimizer.
  double link_bytes_per_second = 0.0;        ///< Per GPU, for the collectives (N > 1).
  double compute_seconds = 0.0;              ///< Forward + backward per GPU per step.
};

/// Memory the placement may use; 0 = not limited.
struct MachineMemory {
  double device_bytes = 0.0;  ///< Per GPU.
  double host_bytes = 0.0;    ///< The node's.
  double nvme_bytes = 0.0;    ///< The node's.
};

/// One resource's time in a step.
struct ResourceSeconds {
  std::string name;  ///< compute, device_to_host, host_to_device, nvme, cpu_optimizer, link.
  double seconds = 0.0;
};

struct StepPrediction {
  std::vector<ResourceSeconds> resources;  ///< Those the placement uses, with rates known.
  double forward_seconds = 0.0;
  double backward_seconds = 0.0;
  double update_seconds = 0.0;
  double commit_seconds = 0.0;  ///< Transfers after the pipeline: none (kept for --json).
  double step_seconds = 0.0;    ///< See the file comment.
  std::string bound_by;         ///< The resource with the most time.
  /// Resources the placement uses whose rate was not given ("nvme read", ...).
  std::vector<std::string> unknown;
  /// Whether it fits MachineMemory; if not, `why_not` says which tier and by how much.
  bool fits = true;
  std::string why_not;
};

/// Bytes of NVMe the engine needs per byte of state it keeps there: transactional steps write
/// a shadow copy and switch to it at the commit.
inline constexpr double kNvmeShadowFactor = 2.0;

/// The step time and the fit of one placement row of PlanMemory(input).
StepPrediction PredictStep(const PlanInput& input, const PlanRow& row, const MachineRates& rates,
                           const MachineMemory& memory);

/// The index of the fastest row that fits (ties within 2% go to the earlier, less offloaded
/// row), among rows whose rates are all known when any of those fits; -1 when none fits.
int ChoosePlacement(const std::vector<StepPrediction>& predictions);

}  // namespace strata::offload
