// Chunk: one chunk's storage in every tier, and how it is laid out.
//
// Storage is laid out once by Engine::Impl::Initialize and never reallocated, except the device
// copy of offloaded parameters, which Residency owns (residency.h). Where the chunk stands in a
// step, and what the step keeps for it, is the step pipeline's (step/chunk_step.h), not here.
// The transition that changes several fields at once (FlipNvmeShadows) is a method, so that it
// is written once.
#pragma once

#include <cstddef>
#include <vector>

#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"
#include "strata/core/device.h"
#include "strata/core/staging_pool.h"
#include "strata/nvme/swap_space.h"
#include "strata/offload/engine.h"

namespace strata::offload {

class Chunk {
 public:
  size_t numel = 0;
  ChunkPlacement placement;
  // The elements whose optimizer states this rank keeps and updates: the whole chunk, or with
  // several ranks (ZeRO stages 1 and 2) this rank's shard of it; and the parameter-group runs
  // in it, with offsets from its first element.
  ChunkShard shard;
  std::vector<ChunkSegment> segments;
  // ZeRO stage 3 (a trained chunk with several ranks): host_params, param_copy and the NVMe
  // extents hold only this rank's shard of the working parameters; Acquire gathers the whole
  // chunk (ParamGather).
  bool params_sharded = false;

  // Device-home parameters: the working parameters and their gradient buffer, always there.
  // (Offloaded parameters come and go with Residency.)
  DeviceBuffer params;
  DeviceBuffer grads;

  // Host.
  AlignedBuffer grads_landing;  // The working-dtype gradients copied out of the device.
  // fp32 sum over micro-steps (gradient_accumulation_steps > 1), and with several ranks the
  // input of the reduce-scatter (without accumulation, several ranks reduce from the
  // ReduceRing's few buffers instead).
  AlignedBuffer grads_sum;
  AlignedBuffer grads_shard;  // Several ranks: this rank's shard of the sum over ranks.
  AlignedBuffer param_copy;   // New working parameters (device- and host-home parameters).
  // optimizer.delayed_update: the parameters a delayed step made, held back from the device
  // until the next step is done with the ones it has (StepPipeline::Released, or the next
  // Step() at the latest).
  AlignedBuffer delayed_params;
  AlignedBuffer host_params;  // Host-home working parameters.
  AlignedBuffer host_states;  // Host-home optimizer states.
  // Where a speculative update (StepPipeline) writes host-home states, leaving host_states as
  // they were for a verdict that clips or overflows; the commit swaps the two. Allocated where
  // the host budget has room; a chunk without one waits for the verdict.
  AlignedBuffer host_state_shadow;
  // NVMe-kept states, gated steps: the working parameters before a speculative update (the
  // master it read, rounded), which a roll-back puts back on the device without reading the
  // states again. Allocated where the host budget has room left.
  AlignedBuffer params_before;

  // Device-home optimizer states (and their fp32 gradient sum for accumulation).
  DeviceBuffer device_states;
  DeviceBuffer device_grads_sum;

  // NVMe: current and shadow extents (allocated by the placement); a step (or a Load) writes
  // the shadow, and FlipNvmeShadows makes it current.
  nvme::ExtentId state_extents[2];
  nvme::ExtentId param_extents[2];
  nvme::ExtentId state_extent() const { return state_extents[state_current_]; }
  nvme::ExtentId param_extent() const { return param_extents[param_current_]; }
  nvme::ExtentId state_shadow() const { return state_extents[1 - state_current_]; }
  nvme::ExtentId param_shadow() const { return param_extents[1 - param_current_]; }
  /// Makes the shadow extents of what lives on NVMe current, the old current ones the next
  /// shadows: the point of no return of a commit (ChunkStep::MakeUpdateCurrent) and of a switch to
  /// new state (Engine::Impl::SwitchToNewState). Loop thread, with no read of the extents in flight
  /// (fetches and read-aheads read the current ones).
  void FlipNvmeShadows();

  bool params_offloaded() const { return placement.params != Tier::kDevice; }
  /// Frozen parameters only: no gradients, no optimizer states, never in a step. Its working
  /// parameters are all it stores.
  bool frozen() const { return !placement.optimizer_states.has_value(); }
  size_t working_bytes(size_t element_bytes) const { return numel * element_bytes; }
  /// Working parameters its home holds (host_params, param_copy, the NVMe extents): this
  /// rank's shard with stage 3, else the whole chunk.
  size_t param_home_numel() const { return params_sharded ? shard.numel() : numel; }
  size_t param_home_bytes(size_t element_bytes) const { return param_home_numel() * element_bytes; }
  /// Residency reads its parameters from NVMe itself (stage 3's come gathered, ParamGather).
  bool fetched_from_nvme() const { return placement.params == Tier::kNvme && !params_sharded; }
  /// Device memory it takes while resident: parameters and gradients (parameters only when
  /// frozen).
  size_t device_slot_bytes(DType working_dtype) const {
    return frozen() ? AlignUp(working_bytes(DTypeSize(working_dtype)), kHostAlignment)
                    : ChunkDeviceBytes(numel, working_dtype);
  }
  /// Bytes of the fp32 state this rank keeps for it (and a checkpoint holds): master | exp_avg |
  /// exp_avg_sq of its shard, or just the values (its working parameters widened) when frozen.
  size_t state_bytes() const {
    return frozen() ? numel * sizeof(float) : ChunkStateBytes(shard.numel());
  }

 private:
  // Which of state_extents and param_extents is current (FlipNvmeShadows).
  int state_current_ = 0;
  int param_current_ = 0;
};

}  // namespace strata::offload
