// StepPipeline: a step from the gradients of backward to the commit that makes it visible.
//
// docs/architecture.md, "A step", tells it once: each chunk's journey (land, gate, read ahead,
// update, write back, upload), speculation, the delayed update, several ranks' collectives and
// what a failed step leaves for its retry. Where each part is: GradsReady and the landing in
// step_landing.cpp, the journey (and Released) in step_update.cpp, Step() and the verdict of a
// gated step in step_pipeline.cpp, the commit in step_commit.cpp, the delayed update in
// step_delayed.cpp and the collectives of several ranks in step_sharded.cpp. Each chunk's part in
// the step is its ChunkStep (chunk_step.h), which only this pipeline writes.
//
// Threads: GradsReady, Step and the accessors run on the trainer thread (or any thread, for the
// accessors) and take `mutex_`; everything else runs on the loop thread. `mutex_` guards the
// phases' writes, the micro-step counts, the hyper-parameter snapshot, the loss scaler and
// whether a step is running. The loop-only state (StepState, the preloader) needs no lock.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <optional>
#include <vector>

#include "engine/chunk.h"
#include "engine/loop_sync.h"
#include "engine/thread_signal.h"
#include "step/state_preloader.h"
#include "step/step_progress.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "strata/offload/engine.h"
#include "strata/offload/loss_scaler.h"
#include "update/updater.h"

namespace strata::offload {

/// What one step's updates use, fixed at the step's first GradsReady so that every chunk of the
/// step is updated alike, however early its update starts.
struct StepHyperParams {
  double lr = 0.0;
  /// optimizer.delayed_update applies (from its step on): the step's new parameters are held
  /// back from the device until the next step is done with the chunk, and the next step's
  /// forward may run while this one updates.
  bool delayed = false;
};

struct ChunkStep;  // chunk_step.h: private to the step's files.
class StepEngine;  // step_engine.h.

class StepPipeline {
 public:
  StepPipeline(StepEngine& engine, const EngineOptions& options);
  ~StepPipeline();  // Out of line: ChunkStep is complete only in the step's files.

  /// Makes each chunk's step state (its signals with it) and starts the first preloads. Once,
  /// after the chunks exist.
  void Initialize();

  // --- Trainer thread ---
  Status GradsReady(size_t chunk, TrainerStream stream);
  std::future<Result<StepReport>> Step();
  /// Engine::AbandonStep: ends the open step with nothing of it kept.
  Status AbandonStep();
  /// FailedPrecondition naming `chunk` when a step is running or the chunk's update may be
  /// (from its last GradsReady until the step completes): its parameters and master may change.
  /// `acquire`: the trainer's Acquire, which a delayed step (StepHyperParams::delayed) allows
  /// while it runs, since the device's parameters stay as they are until the next step is done;
  /// with optimizer.delayed_update on, an Acquire during a step that is not delayed waits for it.
  /// After a failed step, Acquire is refused for a device-kept chunk the retry still has to
  /// update from the trainer's gradient buffer.
  Status CheckReadable(size_t chunk, const std::string& operation, bool acquire = false) const;
  /// After each Release: once the chunk has had this step's last GradsReady, the trainer is done
  /// with its device parameters, and the parameters a delayed step held back go up, or those
  /// of an update that finished while the trainer held the chunk.
  void Released(size_t chunk);
  /// Between steps, before Save or a state write: every chunk's parameters a delayed step held
  /// back go to the device now, and are there when it returns. Checkpoints hold masters, so
  /// this makes the run that saved and a run resumed from it continue alike, and a write (which
  /// rewrites its chunk's device parameters from the master) leave no chunk behind the others.
  Status FlushDelayedParameters();
  /// FailedPrecondition unless between steps: no step running and no gradients held.
  Status CheckBetweenSteps(const std::string& operation) const;

  // --- Any thread ---
  /// Whether updates need the step's verdict (global norm, overflow, the gradients unchanged
  /// since GradsReady): clipping, fp16 or optimizer.recheck_gradients.
  bool gated() const;
  /// optimizer.recheck_gradients: Step() reads the gradients again where the trainer keeps them.
  bool rechecks() const { return options_.optimizer.recheck_gradients; }
  double loss_scale() const;
  int64_t step_count() const { return step_count_.load(); }
  int64_t iteration_count() const;
  /// The learning rate of the steps whose first GradsReady comes after this call.
  void SetLearningRate(double lr);
  LossScalerState scaler_state() const;
  /// Between steps: what Load restores (`chunk_steps`: each chunk's updates so far).
  void Restore(const LossScalerState& scaler, int64_t step_count,
               const std::vector<int64_t>& chunk_steps);
  /// Between steps: the optimizer updates `chunk` has had (its bias correction's step), which
  /// Save records.
  int64_t ChunkStepsTaken(size_t chunk) const;
  /// Between steps, when a state write has just rewritten `chunk`'s device parameters: they
  /// supersede the parameters a delayed step held back for it, if any are left, which then never
  /// go up. No Release or commit looks meanwhile.
  void DropDelayedParameters(size_t chunk);

  // --- Loop thread ---
  /// The read-ahead of NVMe-kept states, which the updates take their states from: the
  /// engine's placement opens it, and a switch to new states (Load, state writes) drops and
  /// restarts it between steps.
  StatePreloader& preloader() { return preloader_; }
  /// Shutdown: journeys waiting for a verdict that will never come give up.
  void Cancel();

 private:
  /// The step in progress (loop thread only).
  struct StepState {
    // Where the step stands (step_progress.h): Step() called, rechecking, committing, ...
    StepProgress progress = StepProgress::kCollecting;
    // AbandonStep asked for it: the verdict drops every update, and the commit counts nothing.
    bool abandon = false;
    // optimizer.recheck_gradients: how many chunks' gradients had changed at Step().
    size_t changed_chunks = 0;
    std::optional<std::promise<Result<StepReport>>> promise;
    std::chrono::steady_clock::time_point started;
    size_t arrived = 0;    // Chunks whose gradients have landed.
    size_t used = 0;       // Chunks with gradients this step, known once Step() is called.
    bool decided = false;  // Gated steps: the global norm/overflow verdict is in.
    bool skip = false;     // fp16 overflow.
    bool clipped = false;  // The verdict scales the gradients down (clip coefficient < 1).
    // Chunks updated ahead of the verdict whose journeys have not yet kept or rolled back the
    // update: the step cannot commit before they do.
    size_t speculations_open = 0;
    // What the chunks arrived so far say of the verdict: the global norm only grows, and one
    // non-finite chunk makes an fp16 step skip. Once either says "roll back", no chunk more
    // updates ahead of the verdict.
    double arrived_sum_of_squares = 0.0;
    bool arrived_non_finite = false;
    bool rolled_back = false;  // Some speculative update of this step was rolled back.
    double grad_scale = 1.0;
    double grad_norm = 0.0;
    size_t updates_running = 0;
    Status error;  // First failure of this attempt.
    // Several ranks: this rank's outcome, held until every rank's is in (AgreeOnStep).
    std::optional<Result<StepReport>> outcome;
    bool outcome_completed = false;
    // The outcome all-reduce's status and count of failed ranks, once done.
    std::optional<std::pair<Status, std::vector<int>>> agreement;
  };

  // step_sharded.cpp
  bool sharded() const;
  /// Who reads a ReduceRing slot once its collective is done: the journey, which sums what the
  /// ranks sent (quantized gradients) or adds the reduced shard into the chunk's (reducing every
  /// micro-step); else the collective itself, which reduces straight into grads_shard.
  bool JourneyReadsReduceSlot() const;
  /// At `chunk`'s GradsReady (trainer thread, under mutex_): readies its signals at the last
  /// micro-step and queues the reduce-scatters whose turn has come (reduce_sequence_, once a
  /// step or once each micro-step).
  void DeclareReduceLocked(size_t chunk, bool last);
  void EnqueueReduceLocked(size_t chunk);
  /// Reducing every micro-step, before micro-step `micro_step` (> 1) of `chunk` lands: waits
  /// until the one before has been taken from the landing buffer (under mutex_, which it lets
  /// go meanwhile); FailedPrecondition when that one's reduce-scatter cannot be enqueued yet,
  /// as the wait would never end.
  Status WaitForLandingLocked(size_t chunk, int micro_step, std::unique_lock<std::mutex>& lock);
  /// FailedPrecondition for a step that several ranks cannot take (under mutex_, from Step()).
  Status CheckShardedStepLocked() const;
  /// Queues the norm's all-reduce and the all-gathers of `order`'s chunks (trainer thread).
  void EnqueueStepCollectives(const std::vector<size_t>& order);
  /// Opens grads_summed (or fills the chunk's ReduceRing slot), waits for the reduce-scatter
  /// of `micro_step` (the last, unless reducing every micro-step), sums it into the shard and,
  /// at the last micro-step, measures this rank's shard.
  Awaitable<void> ReduceGrads(size_t chunk, int micro_step);
  /// Once the chunk's reduce-scatter is queued and its ReduceRing slot is free: widens the
  /// landed gradients into it (or takes grads_sum), quantizes them into what the all-to-all
  /// sends (quantized gradients), and marks the slot filled. Returns the reduce-scatter's
  /// number (ChunkStep::kNeverQueued: Cancel ended the step).
  Awaitable<uint64_t> FillReduceSlot(size_t chunk);
  /// Opens shard_updated, waits for the all-gather and uploads what it gathered.
  Awaitable<void> GatherParams(size_t chunk);
  /// With the ranks whose step failed (from the outcome all-reduce, or its own failure):
  /// delivers this rank's outcome, or the step's failure elsewhere. Loop thread.
  void AgreeOnStep(Status collective, std::vector<int> failed_ranks);
  /// Delivers once both this rank's outcome and the agreement are in.
  void DeliverAgreedStep();

  // step_landing.cpp
  Status QueueLanding(size_t chunk, const ChunkView& view, TrainerStream stream, int micro_step,
                      bool last);
  Result<cpu_adam::GradientStats> SumAndMeasure(float* sum, const void* grads, size_t numel,
                                                int micro_step, bool last);
  /// sum[i] (+)= grads[i] (of `dtype`) widened to fp32; `first` overwrites (a job: it runs on
  /// the optimizer's threads).
  void SumGrads(float* sum, const void* grads, DType dtype, size_t numel, bool first);
  Awaitable<void> LandMicroStep(size_t chunk, int micro_step);
  Awaitable<Status> LandGrads(size_t chunk, int micro_step, bool last);

  // step_update.cpp (UploadDelayedLocked: step_delayed.cpp)
  Awaitable<void> Journey(size_t chunk, int micro_step);
  /// Whether the chunk's update may run ahead of the gated step's verdict: the verdict is not
  /// in yet, what has arrived does not already show it will clip or overflow, and the update
  /// can be rolled back (see the top of this file).
  bool CanSpeculate(size_t chunk) const;
  /// Updates the chunk where one is left to do; `speculative`: ahead of the verdict.
  Awaitable<void> Update(size_t chunk, bool speculative = false);
  /// After the verdict: keeps the chunk's speculative update (uploading parameters that waited
  /// for it) or rolls it back to kArrived, with the device's parameters.
  Awaitable<void> ResolveSpeculation(size_t chunk);
  /// Sets `stepped` when the chunk's home states hold this step's update (even if a later
  /// stage failed), which decides the phase a failure leaves it in. A speculative update writes
  /// host-kept states into their shadow buffer, so it never leaves the chunk stepped.
  Awaitable<Status> UpdateOnHost(size_t chunk, bool republish, bool speculative, bool& stepped);
  /// Rounds a chunk's current master (host-kept, or read back from its current NVMe extent) to
  /// its working parameters and uploads them: what the device held before a speculative upload
  /// the verdict rolled back. Sets restore_params when that fails.
  Awaitable<Status> RestoreParameters(size_t chunk);
  /// Zero copy (Impl::ZeroCopy): whether the chunk's update may write its new working
  /// parameters straight into the device's instead of param_copy; once the trainer has released
  /// the chunk, waits for its work queued on them.
  Awaitable<bool> ClaimParamsInPlace(size_t chunk, bool speculative);
  /// Queues the upload of a device-home chunk's new parameters now, where the step allows it;
  /// while the trainer holds the chunk, leaves them for its Release (UploadReleased).
  Status UploadEarly(size_t chunk);
  /// Spawned by Released: sends what UploadEarly left for the Release, if the update is still
  /// staged and the commit has not begun.
  Awaitable<void> UploadReleased(size_t chunk);
  /// Queues the upload of the parameters a delayed step held back for `chunk` (delayed_params)
  /// behind the trainer's last use of the chunk, if it has them and the trainer has released
  /// it. Under mutex_.
  Status UploadDelayedLocked(size_t chunk);
  Awaitable<Status> UpdateOnDevice(size_t chunk);
  /// The optimizer step of chunk's states (master | exp_avg | exp_avg_sq at `states`, the
  /// updated ones to `states_out`, which is `states` for an update in place) with this step's
  /// hyper-parameters and each parameter group's settings, for an Updater to run.
  ChunkUpdate UpdateOf(size_t chunk, float* states, float* states_out, const void* grads,
                       DType grad_dtype, void* param_copy, double grad_scale) const;
  /// Reads ahead the states of the chunks whose gradients come next in backward (the last
  /// chunks, at a commit: NVMe works while the next forward runs), as the preloader's policy
  /// allows; called again whenever an update returns its buffer.
  void ReadAhead();

  // step_pipeline.cpp; from MaybeFinish on, step_commit.cpp
  /// Step()'s work on the loop: the request, a retry of what a failed attempt left (an
  /// AbandonStep's when abandoning_).
  Awaitable<void> StartStep(std::promise<Result<StepReport>> promise);
  /// Step() and AbandonStep: refuses what they cannot do, or starts StartStep.
  std::future<Result<StepReport>> RequestStep(bool abandon);
  void Arrive(size_t chunk);
  /// Whether every chunk that has gradients this step has landed them: the verdict of a gated
  /// step can be made.
  bool AllArrived() const;
  /// Records `error` as this attempt's failure unless another came first.
  void KeepFirstError(Status error);
  /// A step's sum of squared gradients and count of chunks with non-finite ones.
  using VerdictTotals = std::array<double, 2>;
  VerdictTotals LocalTotals() const;
  /// The verdict of a gated step from its totals (summed over ranks): clip coefficient, skip.
  void ApplyVerdict(const VerdictTotals& totals);
  /// What step_ starts each step as: updates without a verdict scale by 1 / ranks (the mean).
  StepState FreshStepState() const;
  /// The factor gradients of global L2 `norm` are scaled by: 1 unless clipping applies.
  double ClipCoefficient(double norm) const;
  /// One rank: the verdict from this rank's totals.
  void Decide();
  /// One rank, gated: makes the verdict once it can be made. Once every chunk has arrived it
  /// decides, except with optimizer.recheck_gradients: then only once Step() was called and
  /// RecheckGradients has run; an abandoned step's verdict drops every update.
  void MaybeDecide();
  /// optimizer.recheck_gradients, at Step(): measures every chunk's gradients again where the
  /// trainer keeps them; a chunk whose checksum changed takes the new measure (and its update
  /// made ahead is rolled back by the verdict). Then decides.
  Awaitable<void> RecheckGradients();
  void MaybeFinish();
  Awaitable<void> Commit();
  /// Ends the step with `result` (`completed`: it committed). Several ranks first agree on
  /// every rank's outcome (AgreeOnStep), so that a step that failed on one fails on all.
  void FinishStep(Result<StepReport> result, bool completed);
  /// A failed attempt, before the trainer hears of it: gradients that landed in place (zero
  /// copy) and that the retry still has to update with are copied into grads_landing.
  void SetGradientsAside();
  /// Completes Step()'s future with `result`.
  void DeliverStep(Result<StepReport> result, bool completed);

  StepEngine& engine_;  // What it uses of the engine (step_engine.h).
  const EngineOptions& options_;
  const int gas_;              // gradient_accumulation_steps
  size_t trained_chunks_ = 0;  // Chunks that are not frozen (set by Initialize).

  mutable std::mutex mutex_;
  bool step_running_ = false;  // Step() called and not yet completed.
  // FinishStep has ended the step and is handing its result to Step()'s future.
  bool delivering_ = false;
  // Notified once a step's future is ready: who waits for a step (StepDone) finds it so.
  mutable std::condition_variable step_done_;
  bool StepDone() const { return !step_running_ && !delivering_; }  // Under mutex_.
  bool step_open_ = false;  // This step's first GradsReady came: hyper_ holds its snapshot.
  // The last attempt failed and Step() has not been called again: no update runs or starts
  // (written on the loop under mutex_).
  bool attempt_failed_ = false;
  // The step in progress (or the failed attempt to retry) is an AbandonStep's: a retry stays one
  // (set by RequestStep, cleared once a step completes; under mutex_).
  bool abandoning_ = false;
  StepHyperParams hyper_;
  double next_lr_;
  LossScaler loss_scaler_;
  std::atomic<int64_t> step_count_{0};

  // Several ranks: the order of every rank's reduce-scatters and all-gathers (the trained
  // chunks, last first; set by Initialize), and the reduce-scatters this step has enqueued so far
  // (reducing every micro-step, the sequence goes round once per micro-step; trainer thread,
  // under mutex_). Step() needs every trained chunk's, so its all-gathers go in the sequence's
  // order.
  std::vector<size_t> reduce_sequence_;
  size_t reduces_enqueued_ = 0;
  ThreadSignal all_arrived_;        // Every chunk's shard is measured (opened on the loop).
  VerdictTotals verdict_totals_{};  // The norm's all-reduce's buffer.
  // The step's outcome on this rank (opened by FinishStep; reset by Step()), and the all-reduce
  // of failed ranks that waits for it.
  ThreadSignal step_outcome_;
  std::vector<double> failed_ranks_;  // One per rank (sized by Initialize): 1 = failed.

  // Each chunk's part in the step, indexed like the engine's chunks (made by Initialize). Who
  // writes each field, and on which thread, is written next to it (chunk_step.h).
  std::vector<ChunkStep> steps_;
  StepState step_;  // Loop thread only, like what follows.
  LoopLatch gate_;  // Opens when a gated step's verdict is in.
  StatePreloader preloader_;
};

}  // namespace strata::offload
