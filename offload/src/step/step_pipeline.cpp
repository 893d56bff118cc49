// The step as a whole: Step() and its refusals, the hyper-parameters and loss scaler, the
// chunks' arrival and the verdict of a gated step (global norm, fp16 overflow). The commit is
// step_commit.cpp's.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "step/chunk_step.h"
#include "step/step_engine.h"
#include "step/step_pipeline.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

StepPipeline::StepPipeline(StepEngine& engine, const EngineOptions& options)
    : engine_(engine),
      options_(options),
      gas_(options.optimizer.gradient_accumulation_steps),
      next_lr_(options.optimizer.lr),
      loss_scaler_(options.precision),
      preloader_(engine.chunks(), steps_, engine.metrics(),
                 [&engine](Awaitable<void> work) { engine.Spawn(std::move(work)); }) {}

StepPipeline::~StepPipeline() = default;

void StepPipeline::Initialize() {
  steps_ = std::vector<ChunkStep>(engine_.chunks().size());
  for (size_t i = 0; i < engine_.chunks().size(); ++i) {
    ChunkStep& s = steps_[i];
    s.grads_copied.emplace(0);
    s.grads_reduced.emplace(0);
    s.reduce_queued.emplace(0);
    s.shard_sum_turn.emplace(1);
    s.params_gathered.emplace(0);
    if (!engine_.chunks()[i].frozen()) ++trained_chunks_;
  }
  failed_ranks_.assign(size_t(engine_.ranks()), 0.0);
  for (size_t i = engine_.chunks().size(); i-- > 0;) {
    if (!engine_.chunks()[i].frozen()) reduce_sequence_.push_back(i);
  }
  step_ = FreshStepState();
  boost::asio::post(engine_.loop().executor(), [this] { ReadAhead(); });
}

StepPipeline::StepState StepPipeline::FreshStepState() const {
  return StepState{.grad_scale = 1.0 / engine_.ranks()};
}

bool StepPipeline::gated() const {
  return options_.optimizer.gradient_clipping > 0.0 || loss_scaler_.checks_overflow() || rechecks();
}

double StepPipeline::loss_scale() const {
  std::lock_guard lock(mutex_);
  return loss_scaler_.scale();
}

int64_t StepPipeline::iteration_count() const {
  std::lock_guard lock(mutex_);
  return loss_scaler_.state().iteration;
}

void StepPipeline::SetLearningRate(double lr) {
  std::lock_guard lock(mutex_);
  next_lr_ = lr;
}

LossScalerState StepPipeline::scaler_state() const {
  std::lock_guard lock(mutex_);
  return loss_scaler_.state();
}

void StepPipeline::Restore(const LossScalerState& scaler, int64_t step_count,
                           const std::vector<int64_t>& chunk_steps) {
  std::lock_guard lock(mutex_);
  loss_scaler_.Restore(scaler);
  step_count_.store(step_count);
  for (size_t i = 0; i < engine_.chunks().size(); ++i) {
    steps_[i].steps_taken = chunk_steps[i];
  }
  engine_.metrics().loss_scale->Set(loss_scaler_.scale());
}

int64_t StepPipeline::ChunkStepsTaken(size_t chunk) const {
  std::lock_guard lock(mutex_);
  return steps_[chunk].steps_taken;
}

void StepPipeline::DropDelayedParameters(size_t chunk) {
  // Before Initialize (the initial values are written first) no step has held anything back.
  if (chunk >= steps_.size()) return;
  std::lock_guard lock(mutex_);
  steps_[chunk].params_delayed = false;
}

Status StepPipeline::CheckReadable(size_t chunk, const std::string& operation, bool acquire) const {
  std::unique_lock lock(mutex_);
  if (acquire && (options_.optimizer.delayed_update || engine_.gathers_params())) {
    // A trainer overlaps the next forward with every step when updates are delayed; a step
    // before delayed_update_from_step is exact, so the forward waits for it. With stage 3 an
    // Acquire gathers across ranks, so whether it does must not hang on how far this rank's
    // step has got: it waits for the step too.
    step_done_.wait(lock, [this] { return StepDone() || (step_running_ && hyper_.delayed); });
  }
  if (attempt_failed_ && engine_.sharded() && (!acquire || engine_.gathers_params())) {
    // The ranks whose own step succeeded committed it; the others did not: their shards (and
    // recorded orders) differ, and so would what a gather returns. A stage 1 or 2 Acquire reads
    // only this rank's own copy.
    return FailedPrecondition(operation + " after a failed step across ranks" +
                              (acquire ? " with zero_optimization.stage 3" : "") +
                              ": the ranks' parameters and states may differ; restart the ranks");
  }
  // The next step's forward: the device's parameters stay until it is done with the chunk.
  if (acquire && step_running_ && hyper_.delayed) return Status();
  if (step_running_) {
    return FailedPrecondition(operation + " while a step is running; wait for Step() to complete");
  }
  const Chunk& c = engine_.chunks()[chunk];
  const ChunkStep& s = steps_[chunk];
  const ChunkPhase phase = s.phase_now();
  if (acquire && attempt_failed_ && phase == ChunkPhase::kArrived && gas_ == 1 &&
      c.placement.optimizer_states == Tier::kDevice) {
    // The device updates this chunk from the trainer's gradient buffer itself, and the retry
    // still has to (SetGradientsAside keeps the host's own copies instead).
    return FailedPrecondition(operation + ": chunk " + std::to_string(chunk) +
                              " keeps its optimizer states on the device, which still has to "
                              "update it from the failed step's gradients; call Step() again to "
                              "retry it first");
  }
  if (phase != ChunkPhase::kIdle && phase != ChunkPhase::kAccumulating && !attempt_failed_) {
    return FailedPrecondition(
        operation + ": chunk " + std::to_string(chunk) +
        " received its last gradients of this step, so its update may be running; read it "
        "after Step() completes");
  }
  return Status();
}

Status StepPipeline::CheckBetweenSteps(const std::string& operation) const {
  std::lock_guard lock(mutex_);
  if (step_running_) return FailedPrecondition(operation + " while a step is running");
  for (size_t i = 0; i < engine_.chunks().size(); ++i) {
    if (steps_[i].micro_steps > 0) {
      return FailedPrecondition(operation + " while chunk " + std::to_string(i) +
                                " holds gradients of an unfinished step; call Step() first");
    }
  }
  return Status();
}

std::future<Result<StepReport>> StepPipeline::Step() { return RequestStep(/*abandon=*/false); }

Status StepPipeline::AbandonStep() {
  {
    std::lock_guard lock(mutex_);
    if (!rechecks()) {
      return FailedPrecondition(
          "AbandonStep needs optimizer.recheck_gradients: without it, updates that started "
          "during backward are not all held for Step()'s verdict, so they cannot be dropped");
    }
    // A failed abandon is retried by the next AbandonStep (or Step(): it stays an abandon).
    if (attempt_failed_ && !abandoning_) {
      return FailedPrecondition(
          "AbandonStep() after a failed step; call Step() again to retry it first");
    }
    if (std::all_of(steps_.begin(), steps_.end(),
                    [](const ChunkStep& s) { return s.micro_steps == 0; })) {
      return Status();  // No gradients declared: nothing to drop.
    }
  }
  return RequestStep(/*abandon=*/true).get().status();
}

std::future<Result<StepReport>> StepPipeline::RequestStep(bool abandon) {
  std::promise<Result<StepReport>> promise;
  std::future<Result<StepReport>> future = promise.get_future();
  bool delayed = false;
  const std::string call = abandon ? "AbandonStep()" : "Step()";
  {
    std::lock_guard lock(mutex_);
    Status refused;
    if (step_running_) refused = FailedPrecondition(call + " while the previous step is running");
    // A chunk gets gradients in every micro-step or in none (it is not updated this step).
    const std::vector<Chunk>& chunks = engine_.chunks();
    for (size_t i = 0; i < chunks.size() && refused.ok() && !abandon; ++i) {
      if (steps_[i].micro_steps != gas_ && steps_[i].micro_steps != 0) {
        refused = FailedPrecondition(
            "chunk " + std::to_string(i) + " received the gradients of " +
            std::to_string(steps_[i].micro_steps) + " of " + std::to_string(gas_) +
            " micro-steps; call GradsReady for a chunk in every micro-step of a step, or in "
            "none (then it is not updated)");
      }
    }
    if (refused.ok()) refused = CheckShardedStepLocked();
    if (refused.ok() && std::all_of(steps_.begin(), steps_.end(),
                                    [](const ChunkStep& s) { return s.micro_steps == 0; })) {
      // Some chunks may sit a step out, but a step without any gradients is a trainer's bug.
      refused =
          FailedPrecondition("Step() before any GradsReady: no chunk (chunk 0 to " +
                             std::to_string(chunks.size() - 1) + ") received gradients this step");
    }
    if (refused.ok()) {
      if (std::optional<size_t> held = engine_.residency().FirstAcquired()) {
        refused = FailedPrecondition(
            call + " while chunk " + std::to_string(*held) +
            " is acquired; Release every chunk first (the step replaces its parameters)");
      }
    }
    // The trainer is done with every chunk: parameters a delayed step held back go up now at
    // the latest (most went as the chunks were released after their last gradients).
    for (size_t i = 0; i < chunks.size() && refused.ok(); ++i) {
      refused =
          UploadDelayedLocked(i).WithContext("uploading the parameters chunk " + std::to_string(i) +
                                             " was delayed from the last step");
    }
    if (!refused.ok()) {
      promise.set_value(refused);
      return future;
    }
    step_running_ = true;
    abandoning_ = abandoning_ || abandon;
    delayed = hyper_.delayed;
  }
  // Several ranks: the norm's all-reduce, then the parameters' all-gathers, in the order every
  // rank reduced the gradients (CheckShardedStepLocked refused a step without every trained
  // chunk's). They run as their inputs come (docs/architecture.md, "Several ranks").
  if (sharded()) EnqueueStepCollectives(reduce_sequence_);
  if (delayed) {
    // The trainer's next forward runs beside this step: it must find the device's parameters
    // complete (a failure shows again in the commit's own wait). The trainer waits here: a
    // stall. (Gradient buffers need nothing: Acquire waits for a chunk's gradient copy.)
    const auto start = Clock::now();
    engine_.device().SynchronizeStream(Stream::kHostToDevice).IgnoreError();
    engine_.metrics().stall_of(TrainerWait::kStep)
        .Increment(std::chrono::duration<double>(Clock::now() - start).count());
  }
  // Counted like every coroutine, so that an engine destroyed right after Step() finishes the
  // step first.
  engine_.Spawn(StartStep(std::move(promise)));
  return future;
}

Awaitable<void> StepPipeline::StartStep(std::promise<Result<StepReport>> promise) {
  {
    std::lock_guard lock(mutex_);
    attempt_failed_ = false;
    // A retry of a failed abandon stays one, whoever asks: its verdict already dropped the
    // updates.
    step_.abandon = abandoning_;
  }
  Advance(step_.progress, step_.progress == StepProgress::kFailedCommitted
                              ? StepProgress::kRetryingUploads
                              : StepProgress::kRequested);
  step_.promise.emplace(std::move(promise));
  step_.started = Clock::now();
  step_.used = 0;
  for (size_t i = 0; i < engine_.chunks().size(); ++i) {
    if (steps_[i].micro_steps > 0) {
      ++step_.used;
    } else if (!engine_.chunks()[i].frozen()) {
      // Sits this step out: the states it read ahead would hold a staging buffer that the
      // journeys of this step need.
      engine_.Spawn(preloader_.Drop(i));
    }
  }
  // Chunks without gradients this step are known now: a gated step may be decided. (Several
  // ranks decide through a collective, and every chunk has gradients.)
  if (gated() && !sharded()) MaybeDecide();
  // A retry after a failed attempt finishes what that attempt left (docs/architecture.md, "Failure
  // and retry"). (Several ranks do not retry, and their journeys update and gather each chunk
  // themselves.)
  if (!sharded() && !step_.skip && (!gated() || step_.decided)) {
    for (size_t i = 0; i < engine_.chunks().size(); ++i) {
      const ChunkPhase phase = steps_[i].phase_now();
      if (steps_[i].update_at_commit) continue;  // The commit's to update.
      if (phase == ChunkPhase::kArrived || phase == ChunkPhase::kStepped) {
        auto retry = [](StepPipeline* self, size_t chunk) -> Awaitable<void> {
          co_await self->Update(chunk);
          self->MaybeFinish();
        };
        engine_.Spawn(retry(this, i));
      }
    }
  }
  MaybeFinish();
  co_return;
}

void StepPipeline::Arrive(size_t chunk) {
  ChunkStep& s = steps_[chunk];
  {
    std::lock_guard lock(mutex_);
    s.MoveTo(ChunkPhase::kArrived);
  }
  ++step_.arrived;
  if (s.stats.all_finite) {
    step_.arrived_sum_of_squares += s.stats.sum_of_squares;
  } else {
    step_.arrived_non_finite = true;
  }
  if (!s.land_status.ok()) {
    KeepFirstError(
        s.land_status.WithContext("measuring the gradients of chunk " + std::to_string(chunk)));
  }
  if (!AllArrived()) return;
  if (sharded()) {
    all_arrived_.Open(Status());  // The norm's all-reduce may read every chunk's stats.
  } else if (gated()) {
    MaybeDecide();
  }
}

bool StepPipeline::AllArrived() const {
  // Before Step() only every trained chunk arriving says so; frozen chunks never arrive.
  return step_.arrived == trained_chunks_ || (Requested(step_.progress) && step_.arrived == step_.used);
}

StepPipeline::VerdictTotals StepPipeline::LocalTotals() const {
  // Sums go in chunk order so results are reproducible.
  VerdictTotals totals = {0.0, 0.0};
  for (const ChunkStep& each : steps_) {
    if (each.micro_steps == 0) continue;  // No gradients this step.
    if (each.stats.all_finite) {
      totals[0] += each.stats.sum_of_squares;
    } else {
      totals[1] += 1.0;
    }
  }
  return totals;
}

void StepPipeline::Decide() { ApplyVerdict(LocalTotals()); }

void StepPipeline::MaybeDecide() {
  if (step_.decided || step_.progress == StepProgress::kRechecking || !AllArrived()) return;
  if (step_.abandon) {
    // Nothing of this step stays: updates made ahead roll back, and no chunk updates.
    step_.decided = true;
    step_.skip = true;
    gate_.Open();
    return;
  }
  if (!rechecks()) {
    Decide();
    return;
  }
  if (!Requested(step_.progress)) return;  // The trainer may still change the gradients.
  Advance(step_.progress, StepProgress::kRechecking);
  engine_.Spawn(RecheckGradients());
}

Awaitable<void> StepPipeline::RecheckGradients() {
  StepEngine& e = engine_;
  std::vector<size_t> used;
  for (size_t i = 0; i < steps_.size(); ++i) {
    if (steps_[i].micro_steps > 0 && steps_[i].land_status.ok()) used.push_back(i);
  }
  // Where the trainer keeps them (CheckRecheckPlacement: device-home parameters on a device the
  // CPU reads), measured in the same pass as the checksum; one job, each chunk's pass parallel.
  std::vector<Result<cpu_adam::GradientStats>> now(used.size(), cpu_adam::GradientStats{});
  auto measure = [&] {
    for (size_t k = 0; k < used.size(); ++k) {
      const Chunk& c = e.chunks()[used[k]];
      now[k] = e.cpu().ComputeGradientStats(c.grads.data(), e.working_dtype(), c.numel,
                                                  /*checksum=*/true);
    }
  };
  co_await AwaitJob(e.jobs(), measure, &e.jobs_in_flight());
  for (size_t k = 0; k < used.size(); ++k) {
    ChunkStep& s = steps_[used[k]];
    if (!now[k].ok()) {
      KeepFirstError(now[k].status().WithContext("measuring the gradients of chunk " +
                                                 std::to_string(used[k]) + " again at Step()"));
      continue;
    }
    const bool changed = now[k]->checksum != s.stats.checksum;
    // The verdict measures the gradients as they are now, changed or not: an edit that came
    // while the landing read them may have reached its checksum but not its sum.
    s.stats = *now[k];
    if (!changed) continue;
    s.grads_changed = true;
    ++step_.changed_chunks;
    e.metrics().changed_gradients->Increment(1.0);
  }
  Advance(step_.progress, StepProgress::kRequested);
  Decide();
  MaybeFinish();
}

void StepPipeline::ApplyVerdict(const VerdictTotals& totals) {
  // Several ranks sum their gradients: the step takes their mean, as DeepSpeed and DDP do.
  const double scale = loss_scale() * engine_.ranks();
  step_.decided = true;
  const bool finite = totals[1] == 0.0;
  step_.skip = loss_scaler_.checks_overflow() && !finite;
  // Without a loss scaler a non-finite gradient does not skip the step, but the reported norm
  // says so (NaN, where torch's clip_grad_norm_ returns a non-finite norm); clipping still
  // bounds the finite chunks by their own norm rather than leaving them unclipped.
  const double finite_norm = std::sqrt(totals[0]) / scale;
  step_.grad_norm = finite ? finite_norm : std::nan("");
  const double clip = step_.skip ? 1.0 : ClipCoefficient(finite_norm);
  step_.clipped = clip < 1.0;
  step_.grad_scale = clip / scale;
  gate_.Open();
}

void StepPipeline::KeepFirstError(Status error) {
  if (step_.error.ok()) step_.error = std::move(error);
}

double StepPipeline::ClipCoefficient(double norm) const {
  // DeepSpeed's and torch's clip_grad_norm_: scale by max_norm / (norm + 1e-6) when < 1.
  const double max_norm = options_.optimizer.gradient_clipping;
  return max_norm > 0.0 ? std::min(1.0, max_norm / (norm + 1e-6)) : 1.0;
}

void StepPipeline::Cancel() {
  // A step asked for finishes (all its chunks will arrive and be decided); only journeys of a
  // step the trainer abandoned mid-backward wait for a verdict that will never come.
  if (Requested(step_.progress)) return;
  Advance(step_.progress, StepProgress::kCancelled);
  gate_.Open();
  // Several ranks: without Step() no all-gather was enqueued, nor the reduce-scatter of a chunk
  // declared before its turn came; journeys that wait for one end.
  if (!sharded()) return;
  std::lock_guard lock(mutex_);
  const bool each_micro_step = engine_.reduces_each_micro_step();
  for (size_t i = 0; i < engine_.chunks().size(); ++i) {
    ChunkStep& s = steps_[i];
    const Status cancelled = Cancelled("the engine was destroyed before Step()");
    // The journeys that reduce: one per micro-step declared, or the last micro-step's.
    const int reducing = each_micro_step ? s.micro_steps : s.micro_steps == gas_ ? 1 : 0;
    for (int k = s.reduces_enqueued; k < reducing; ++k) {
      if (engine_.reduces_from_ring()) {
        // The journey learns from the number that no collective comes (ReduceGrads): a result
        // here would go to the first journey waiting, maybe an earlier micro-step's whose
        // collective is still running.
        s.reduce_numbers.push_back(ChunkStep::kNeverQueued);
        s.reduce_queued->Release();
      } else {
        s.reduce_results.push_back(cancelled);
        s.grads_reduced->Release();
      }
    }
    if (s.micro_steps != gas_) continue;
    s.gather_status = cancelled;
    s.params_gathered->Release();
  }
}

}  // namespace strata::offload
