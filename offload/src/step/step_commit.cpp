// The end of a step: when it may commit, the commit that makes every chunk's update visible at
// once (the point of no return: the shadows flip), and the delivery of its outcome to Step()'s
// future, with what a failed attempt leaves for its retry.
#include <chrono>
#include <cmath>
#include <cstring>

#include "step/chunk_step.h"
#include "step/step_engine.h"
#include "step/step_pipeline.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

void StepPipeline::MaybeFinish() {
  if (!Requested(step_.progress) || CommitBegun(step_.progress) || step_.updates_running > 0) {
    return;
  }
  if (step_.speculations_open > 0) return;  // Updated ahead of the verdict, not yet resolved.
  for (const ChunkStep& s : steps_) {
    if (s.phase_now() == ChunkPhase::kLanding) return;  // Gradients still landing.
  }
  // Several ranks: the norm's all-reduce and every chunk's all-gather are done too.
  if ((gated() || sharded()) && !step_.decided) return;
  if (sharded()) {
    for (const ChunkStep& s : steps_) {
      if (s.micro_steps > 0 && !s.gathered) return;
    }
  }
  if (!step_.error.ok() && step_.abandon) {
    // What failed (an update made ahead, a landing) belonged to what the abandon drops.
    step_.error = Status();
  }
  if (!step_.error.ok()) {
    FinishStep(std::exchange(step_.error, Status()), /*completed=*/false);
    return;
  }
  if (!step_.skip) {
    for (const ChunkStep& s : steps_) {
      if (s.micro_steps == 0) continue;  // Not updated this step.
      const bool deferred = s.update_at_commit && s.phase_now() == ChunkPhase::kArrived;
      if (s.phase_now() != ChunkPhase::kUpdated && !deferred) return;  // A journey is on its way.
    }
  }
  // A retry after a failure past the flip commits again without flipping (Commit).
  Advance(step_.progress, step_.progress == StepProgress::kRetryingUploads
                              ? StepProgress::kCommitted
                              : StepProgress::kCommitting);
  engine_.Spawn(Commit());
}

Awaitable<void> StepPipeline::Commit() {
  StepEngine& e = engine_;
  std::vector<Chunk>& chunks = e.chunks();
  const bool skipped = step_.skip;
  Status status;
  if (!skipped && step_.progress == StepProgress::kCommitting) {
    // Device-kept chunks left for the commit (every one, in a transactional step; those the
    // trainer still held, otherwise) are updated now, after the trainer's use of them.
    status = e.residency().OrderAfterTrainerUse(Stream::kCompute);
    for (size_t i = 0; i < chunks.size() && status.ok(); ++i) {
      ChunkStep& s = steps_[i];
      if (!s.update_at_commit || s.phase_now() != ChunkPhase::kArrived) continue;
      {
        std::lock_guard lock(mutex_);
        s.MoveTo(ChunkPhase::kUpdating);  // Claimed: a retry's Update leaves it alone.
      }
      status = co_await UpdateOnDevice(i);
      std::lock_guard lock(mutex_);
      s.MoveTo(status.ok() ? ChunkPhase::kUpdated : ChunkPhase::kArrived);
    }
    if (!status.ok()) {
      FinishStep(status.WithContext("updating the device's share of the optimizer states"),
                 /*completed=*/false);
      co_return;
    }
    // The point of no return: the shadows become current, host-home parameters swap.
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (steps_[i].micro_steps == 0) continue;  // Not updated: its current state stays.
      steps_[i].MakeUpdateCurrent(chunks[i]);
    }
    Advance(step_.progress, StepProgress::kCommitted);
  }
  // Device-home parameters not uploaded yet go up behind the trainer's last use of every chunk;
  // one wait covers them, and that use, before stale device copies are dropped. A delayed step
  // holds its own back instead (below); those held back before went up by Step() at the latest.
  const bool delay = hyper_.delayed && !skipped;
  // (Not for a delayed step, which uploads nothing here: the next forward may be running, and
  // its releases must not hold the commit back.)
  if (!delay) status = e.residency().OrderAfterTrainerUse(Stream::kHostToDevice);
  for (size_t i = 0; i < chunks.size() && status.ok() && !delay; ++i) {
    Chunk& c = chunks[i];
    const ChunkStep& s = steps_[i];
    if (c.placement.params != Tier::kDevice || s.micro_steps == 0) continue;
    if (skipped) {
      // A skipped step puts back only what a rolled-back speculation failed to restore.
      if (s.restore_params) status = co_await RestoreParameters(i);
      continue;
    }
    if (s.params_uploaded) continue;
    const size_t wbytes = c.working_bytes(e.working_size());
    status = e.device().CopyToDevice(c.params.data(), c.param_copy.data(), wbytes);
    if (status.ok()) e.metrics().h2d_bytes->Increment(double(wbytes));
  }
  const Status landed = co_await AwaitStream(e.device(), Stream::kHostToDevice);
  if (status.ok()) status = landed;
  if (!status.ok()) {
    // The step is committed on the host side; a retry uploads again.
    FinishStep(status.WithContext("uploading the step's new parameters to the device"),
               /*completed=*/false);
    co_return;
  }
  if (delay) {
    // Held back until the next step is done with the chunk (Released, or the next Step()).
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (steps_[i].micro_steps == 0) continue;
      std::swap(chunks[i].param_copy, chunks[i].delayed_params);
      steps_[i].params_delayed = true;
    }
  }
  if (!skipped) {
    // The updated chunks' device copies are stale; the others' (frozen chunks, chunks without
    // gradients this step) still hold their parameters and stay.
    std::vector<size_t> updated;
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (steps_[i].micro_steps > 0) updated.push_back(i);
    }
    e.residency().Drop(updated);
  }

  double norm = step_.grad_norm;
  if (!gated() && !sharded()) {
    double sum = 0.0;
    bool finite = true;
    for (const ChunkStep& s : steps_) {
      sum += s.stats.sum_of_squares;
      finite = finite && s.stats.all_finite;
    }
    norm = finite ? std::sqrt(sum) : std::nan("");  // As ApplyVerdict reports it.
  }
  bool stuck = false;
  // An abandoned step counts nothing: no iteration, and the loss scale stays.
  const bool counted = !step_.abandon;
  {
    std::lock_guard lock(mutex_);
    if (counted) {
      stuck = skipped && loss_scaler_.AtMinimumScale();
      loss_scaler_.Update(skipped);
    }
    if (!skipped) step_count_.fetch_add(1);
    for (ChunkStep& s : steps_) {
      if (s.micro_steps == 0) continue;  // Had no part in this step.
      s.EndStep(/*updated=*/!skipped);
    }
    step_open_ = false;
  }
  e.metrics().steps->Increment(skipped ? 0.0 : 1.0);
  e.metrics().skipped_steps->Increment(skipped && counted ? 1.0 : 0.0);
  e.metrics().rolled_back_steps->Increment(step_.rolled_back ? 1.0 : 0.0);
  e.metrics().loss_scale->Set(loss_scale());
  e.residency().StepCommitted();
  ReadAhead();  // The next step's first states, read while its forward runs.
  const double seconds = std::chrono::duration<double>(Clock::now() - step_.started).count();
  e.metrics().step_seconds->Set(seconds);
  if (stuck) {
    FinishStep(FailedPrecondition(
                   "fp16 gradients overflowed with the loss scale already at its minimum (" +
                   std::to_string(options_.precision.min_loss_scale) +
                   "), so it cannot be lowered further (DeepSpeed stops here too); the step was "
                   "skipped. Lower the learning rate, clip gradients, use bf16, or lower "
                   "min_loss_scale"),
               /*completed=*/true);
    co_return;
  }
  const LossScalerState scaler = scaler_state();
  FinishStep(StepReport{.step = step_count_.load(),
                        .iteration = scaler.iteration,
                        .skipped = skipped,
                        .rolled_back = step_.rolled_back,
                        .changed_chunks = int64_t(step_.changed_chunks),
                        .grad_norm = norm,
                        .loss_scale = scaler.scale,
                        .seconds = seconds},
             /*completed=*/true);
}

void StepPipeline::FinishStep(Result<StepReport> result, bool completed) {
  if (!sharded()) {
    DeliverStep(std::move(result), completed);
    return;
  }
  // Several ranks report a step only once every rank's outcome is in (AgreeOnStep).
  Advance(step_.progress, Flipped(step_.progress) ? StepProgress::kFinishingCommitted
                                                  : StepProgress::kFinishing);
  const Status local = result.status();
  step_.outcome.emplace(std::move(result));
  step_.outcome_completed = completed;
  step_outcome_.Open(local);
  if (step_.agreement) DeliverAgreedStep();
}

void StepPipeline::SetGradientsAside() {
  if (gas_ > 1) return;  // The updates read grads_sum.
  StepEngine& e = engine_;
  for (size_t i = 0; i < e.chunks().size(); ++i) {
    const Chunk& c = e.chunks()[i];
    ChunkStep& s = steps_[i];
    // Landed in place (zero copy) and still to update: once the failure is delivered the
    // trainer may Acquire the chunk and write its gradient buffer, and the retry needs these.
    if (!e.ZeroCopy(c) || s.landed_grads == c.grads_landing.data() ||
        s.phase_now() != ChunkPhase::kArrived) {
      continue;
    }
    std::memcpy(c.grads_landing.data(), s.landed_grads, c.working_bytes(e.working_size()));
    s.landed_grads = c.grads_landing.data();
  }
}

void StepPipeline::DeliverStep(Result<StepReport> result, bool completed) {
  std::promise<Result<StepReport>> promise = std::move(*step_.promise);
  // The trainer cannot start the next forward before the step completes: all of it is a stall.
  // (A delayed step's next forward runs beside it: its stall is the next GradsReady's wait.)
  if (!hyper_.delayed) {
    engine_.metrics().stall_of(TrainerWait::kStep)
        .Increment(std::chrono::duration<double>(Clock::now() - step_.started).count());
  }
  if (!completed) SetGradientsAside();
  if (completed) {
    if (result.ok()) engine_.metrics().UpdateRates();
    Advance(step_.progress, StepProgress::kCollecting);  // Checked, then everything starts over.
    step_ = FreshStepState();
    gate_.Reset();
    std::lock_guard lock(mutex_);
    abandoning_ = false;
  } else {
    step_.promise.reset();
    // What the retry redoes: everything left, or only the uploads once the shadows flipped.
    Advance(step_.progress, Flipped(step_.progress) ? StepProgress::kFailedCommitted
                                                    : StepProgress::kFailed);
  }
  {
    std::lock_guard lock(mutex_);
    step_running_ = false;
    attempt_failed_ = !completed;
    delivering_ = true;
  }
  promise.set_value(std::move(result));
  {
    std::lock_guard lock(mutex_);
    delivering_ = false;
  }
  step_done_.notify_all();
}

}  // namespace strata::offload
