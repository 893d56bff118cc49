// Chunk: one chunk's storage in every tier, and where it stands in the current step.
//
// Storage is laid out once by Engine::Impl::Initialize and never reallocated, except the device
// copy of offloaded parameters, which Residency owns (residency.h). A chunk's progress through a
// step is one ChunkPhase; every change goes through Chunk::MoveTo, which checks that the change
// is one the step allows. Who makes each move is written next to it below. The transitions that
// change several fields at once are methods here (FlipNvmeShadows, MakeUpdateCurrent, EndStep),
// so that each is written once.
#pragma once

#include <atomic>
#include <cstddef>
#include <deque>
#include <optional>
#include <vector>

#include "engine/loop_sync.h"
#include "engine/thread_signal.h"
#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"
#include "strata/core/device.h"
#include "strata/core/staging_pool.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "strata/nvme/swap_space.h"
#include "strata/offload/engine.h"

namespace strata::offload {

/// Where a chunk is in the current optimizer step.
enum class ChunkPhase : uint8_t {
  kIdle,          ///< No gradients of this step declared yet.
  kAccumulating,  ///< Some micro-steps' gradients declared, not the last (trainer: GradsReady).
  kLanding,       ///< The last micro-step's gradients declared; they are on their way to the
                  ///< host and being measured (trainer: GradsReady).
  kArrived,       ///< Gradients landed and measured; the update has not run, or ran and failed
                  ///< leaving the chunk's states as they were, or ran ahead of the verdict and
                  ///< was rolled back (loop: the chunk's journey).
  kUpdating,      ///< Its update runs (loop: the journey, or a retry).
  kStepped,       ///< An update failed after the optimizer changed host- or device-home states
                  ///< in place: a retry republishes the parameters and never steps again (loop).
  kUpdated,       ///< New states and parameters are staged for the commit (loop); a
                  ///< speculative update's until the verdict keeps them.
};

/// "idle", "accumulating", ... for messages.
const char* ChunkPhaseName(ChunkPhase phase);

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
  // Where the last landing left the working-dtype gradients, which the landing's sum and
  // measure and then the update read: grads_landing, or with zero copy (Impl::ZeroCopy) the
  // device's gradient buffer itself until a failed step sets them aside in grads_landing for
  // its retry (StepPipeline::SetGradientsAside). Set by GradsReady (trainer thread) before the
  // landing's journey starts; read on the loop and by its jobs.
  const std::byte* landed_grads = nullptr;
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
  /// shadows: the point of no return of a commit (MakeUpdateCurrent) and of a switch to new
  /// state (Engine::Impl::SwitchToNewState). Loop thread, with no read of the extents in
  /// flight (fetches and read-aheads read the current ones).
  void FlipNvmeShadows();
  /// The commit of a step that updated this chunk (StepPipeline::Commit, loop thread): its
  /// NVMe shadows flip, host-home parameters swap in from param_copy, and states a speculative
  /// update wrote into host_state_shadow swap in.
  void MakeUpdateCurrent();

  // --- The step (see ChunkPhase). The phase is moved under the step pipeline's mutex
  // (MoveTo) and read from any thread (phase_now).
  int micro_steps = 0;  // GradsReady calls this step (trainer thread, pipeline mutex).
  // Released once per micro-step when its gradients reach the host (loop thread).
  std::optional<LoopSemaphore> grads_copied;
  cpu_adam::GradientStats stats;  // Of the summed gradients (loop thread).
  Status land_status;             // Failure while summing or measuring them (loop thread).
  bool params_uploaded = false;   // Device-home parameters already carry this step's update.
  // delayed_params holds parameters the device is still to get (pipeline mutex; WriteMemoryHome
  // clears it between steps, when no other thread looks).
  bool params_delayed = false;
  // The device holds the parameters of a speculative update that was rolled back, and putting
  // back the current master, rounded, failed: the commit of a skipped step restores them again,
  // any upload of the chunk clears it (loop thread).
  bool restore_params = false;
  // A device-kept chunk whose update is the commit's to make (loop thread).
  bool update_at_commit = false;
  // Its update ran ahead of a gated step's verdict, as if the step neither clips nor
  // overflows; the verdict keeps it or rolls it back (loop thread: the chunk's journey).
  bool speculated = false;
  // host_state_shadow holds this step's new states, for the commit to swap in (loop thread).
  bool states_in_shadow = false;
  // Optimizer updates this chunk has had (its bias correction's step). A chunk that gets no
  // gradients in a step (an unused expert) is not updated and does not count it, as torch
  // skips a parameter whose .grad is None. Written by the commit and Load.
  int64_t steps_taken = 0;

  // --- Several ranks (step_pipeline.h, "Sharding"): the chunk's collectives. The signals are
  // what the communicator's thread waits on before a collective reads the chunk's buffers (reset
  // by the trainer thread at the chunk's last GradsReady, opened by the loop); the semaphores
  // are released on the loop when a collective is done, with its status.
  // grads_sum holds this rank's gradients: reduce-scatter them. (From the ReduceRing, a slot's
  // number says it instead: ReduceRing::WaitFilled.)
  ThreadSignal grads_summed;
  ThreadSignal shard_updated;  // param_copy holds the shard's new parameters: all-gather them.
  // Released on the loop once per reduce-scatter done, after its status joins reduce_results.
  std::optional<LoopSemaphore> grads_reduced;
  std::deque<Status> reduce_results;
  // Reducing from the ReduceRing (reduce_ring.h): released on the loop once per reduce-scatter
  // enqueued, after its number joins reduce_numbers; that may come after the landing (a trainer
  // that declares gradients out of the reduce order). Queues, not single values: reducing every
  // micro-step, the next micro-step's reduce-scatter may be enqueued, and even done, before this
  // one's journey has taken its own.
  std::optional<LoopSemaphore> reduce_queued;
  std::deque<uint64_t> reduce_numbers;
  // Pushed by Cancel for a reduce-scatter never enqueued (and then no result follows it).
  static constexpr uint64_t kNeverQueued = ~uint64_t{0};
  // Reduce-scatters enqueued this step (pipeline mutex): one, or one per micro-step.
  int reduces_enqueued = 0;
  // Reducing every micro-step: the landing buffer's gradients have been taken (widened into a
  // ReduceRing slot), so the next micro-step may land there; GradsReady waits for it (trainer
  // thread; opened on the loop).
  ThreadSignal landing_taken;
  // Reducing every micro-step: one micro-step at a time adds its reduced shard into
  // grads_shard, in micro-step order (count 1; loop thread).
  std::optional<LoopSemaphore> shard_sum_turn;
  std::optional<LoopSemaphore> params_gathered;
  Status gather_status;   // Loop thread, like what follows.
  bool gathered = false;  // This step's all-gather is done (or failed).

  /// Moves to `to`, checking that the step allows it; a move it does not allow is a bug in the
  /// engine and aborts with both phases named.
  void MoveTo(ChunkPhase to);
  ChunkPhase phase_now() const { return phase_.load(std::memory_order_acquire); }
  /// The end of the chunk's part in a step (the commit, under the pipeline's mutex): back to
  /// kIdle, with what the step gathered reset for the next; `updated`: the step was not
  /// skipped, so its update counts in steps_taken.
  void EndStep(bool updated);

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
  std::atomic<ChunkPhase> phase_{ChunkPhase::kIdle};
  // Which of state_extents and param_extents is current (FlipNvmeShadows).
  int state_current_ = 0;
  int param_current_ = 0;
};

}  // namespace strata::offload
