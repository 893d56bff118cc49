// ChunkStep: where one chunk stands in the current step, and what the step keeps for it.
//
// The step pipeline owns it (StepPipeline::steps_, one per chunk, indexed like the engine's
// chunks) and only the step's files include this header: the rest of the engine goes through
// the pipeline's narrow accessors (StepPipeline::DropDelayedParameters, ChunkStepsTaken) instead
// of reading or writing it. The chunk's storage in every tier is Chunk's (engine/chunk.h).
//
// A chunk's progress through a step is one ChunkPhase; every change goes through
// ChunkStep::MoveTo, which checks that the change is one the step allows. Who makes each move is
// written next to it below. The transitions that change several fields at once are methods
// here (MakeUpdateCurrent, EndStep), so that each is written once.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>

#include "engine/chunk.h"
#include "engine/loop_sync.h"
#include "engine/thread_signal.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/cpu_optimizer.h"

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

/// One chunk's part in the step. Neither copied nor moved (signals, semaphores, an atomic): the
/// pipeline makes them in place, one per chunk.
struct ChunkStep {
  // The phase is moved under the step pipeline's mutex (MoveTo) and read from any thread
  // (phase_now).
  int micro_steps = 0;  // GradsReady calls this step (trainer thread, pipeline mutex).
  // Released once per micro-step when its gradients reach the host (loop thread).
  std::optional<LoopSemaphore> grads_copied;
  // Where the last landing left the working-dtype gradients, which the landing's sum and
  // measure and then the update read: Chunk::grads_landing, or with zero copy (Impl::ZeroCopy)
  // the device's gradient buffer itself until a failed step sets them aside in grads_landing
  // for its retry (StepPipeline::SetGradientsAside). Set by GradsReady (trainer thread) before
  // the landing's journey starts; read on the loop and by its jobs.
  const std::byte* landed_grads = nullptr;
  // Of the summed gradients (loop thread); with optimizer.recheck_gradients its checksum is of
  // the gradients as they landed, which Step() compares with the trainer's buffer then.
  cpu_adam::GradientStats stats;
  // optimizer.recheck_gradients: the trainer changed the gradients after GradsReady; stats now
  // measure them as they are at Step(), and an update made before is rolled back and redone
  // (loop thread).
  bool grads_changed = false;
  Status land_status;            // Failure while summing or measuring them (loop thread).
  bool params_uploaded = false;  // Device-home parameters already carry this step's update.
  // The update is done and its parameters may go up (UploadEarly), but the trainer still held
  // the chunk: its Release sends them (StepPipeline::UploadReleased; loop thread).
  bool upload_at_release = false;
  // Chunk::delayed_params holds parameters the device is still to get (pipeline mutex;
  // WriteMemoryHome clears it between steps through StepPipeline::DropDelayedParameters, when
  // no other thread looks).
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
  // Chunk::host_state_shadow holds this step's new states, for the commit to swap in (loop
  // thread).
  bool states_in_shadow = false;
  // Optimizer updates this chunk has had (its bias correction's step). A chunk that gets no
  // gradients in a step (an unused expert) is not updated and does not count it, as torch
  // skips a parameter whose .grad is None. Written by the commit (EndStep) and by Load
  // (StepPipeline::Restore); Save reads it through StepPipeline::ChunkStepsTaken.
  int64_t steps_taken = 0;

  // --- Several ranks (docs/architecture.md, "Several ranks"): the chunk's collectives. The signals
  // are what the communicator's thread waits on before a collective reads the chunk's buffers
  // (reset by the trainer thread at the chunk's last GradsReady, opened by the loop); the
  // semaphores are released on the loop when a collective is done, with its status.
  // Chunk::grads_sum holds this rank's gradients: reduce-scatter them. (From the ReduceRing, a
  // slot's number says it instead: ReduceRing::WaitFilled.)
  ThreadSignal grads_summed;
  // Chunk::param_copy holds the shard's new parameters: all-gather them.
  ThreadSignal shard_updated;
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
  // Chunk::grads_shard, in micro-step order (count 1; loop thread).
  std::optional<LoopSemaphore> shard_sum_turn;
  std::optional<LoopSemaphore> params_gathered;
  Status gather_status;   // Loop thread, like what follows.
  bool gathered = false;  // This step's all-gather is done (or failed).

  ChunkStep() = default;
  ChunkStep(const ChunkStep&) = delete;
  ChunkStep& operator=(const ChunkStep&) = delete;

  /// Moves to `to`, checking that the step allows it; a move it does not allow is a bug in the
  /// engine and aborts with both phases named.
  void MoveTo(ChunkPhase to);
  ChunkPhase phase_now() const { return phase_.load(std::memory_order_acquire); }
  /// The commit of a step that updated `chunk` (this one's storage; StepPipeline::Commit, loop
  /// thread): its NVMe shadows flip, host-home parameters swap in from param_copy, and states a
  /// speculative update wrote into host_state_shadow swap in.
  void MakeUpdateCurrent(Chunk& chunk);
  /// The end of the chunk's part in a step (the commit, under the pipeline's mutex): back to
  /// kIdle, with what the step gathered reset for the next; `updated`: the step was not
  /// skipped, so its update counts in steps_taken.
  void EndStep(bool updated);

 private:
  std::atomic<ChunkPhase> phase_{ChunkPhase::kIdle};
};

}  // namespace strata::offload
