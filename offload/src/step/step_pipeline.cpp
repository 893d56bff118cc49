// The step as a whole: Step() and its refusals, the verdict of a gated step (global norm, fp16
// overflow), and the commit that makes every chunk's update visible at once.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/engine_impl.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

const char* ChunkPhaseName(ChunkPhase phase) {
  switch (phase) {
    case ChunkPhase::kIdle: return "idle";
    case ChunkPhase::kAccumulating: return "accumulating";
    case ChunkPhase::kLanding: return "landing";
    case ChunkPhase::kArrived: return "arrived";
    case ChunkPhase::kUpdating: return "updating";
    case ChunkPhase::kStepped: return "stepped";
    case ChunkPhase::kUpdated: return "updated";
  }
  return "unknown";
}

void Chunk::MoveTo(ChunkPhase to) {
  using P = ChunkPhase;
  const P from = phase_now();
  bool allowed = false;
  switch (to) {
    case P::kIdle: allowed = from == P::kArrived || from == P::kUpdated; break;  // The commit.
    case P::kAccumulating: allowed = from == P::kIdle || from == P::kAccumulating; break;
    case P::kLanding: allowed = from == P::kIdle || from == P::kAccumulating; break;
    // The journey, a failed update, or the verdict rolling a speculative update back.
    case P::kArrived:
      allowed = from == P::kLanding || from == P::kUpdating || from == P::kUpdated;
      break;
    case P::kUpdating: allowed = from == P::kArrived || from == P::kStepped; break;
    case P::kStepped: allowed = from == P::kUpdating; break;
    case P::kUpdated: allowed = from == P::kUpdating; break;
  }
  if (!allowed) {
    std::fprintf(stderr, "strata: internal error: a chunk moved from %s to %s\n",
                 ChunkPhaseName(from), ChunkPhaseName(to));
    std::abort();
  }
  phase.store(to, std::memory_order_release);
}

StepPipeline::StepPipeline(Engine::Impl& engine, const EngineOptions& options)
    : engine_(engine),
      options_(options),
      gas_(options.optimizer.gradient_accumulation_steps),
      next_lr_(options.optimizer.lr),
      loss_scaler_(options.precision),
      preloader_(engine.chunks_, engine.m_,
                 [&engine](Awaitable<void> work) { engine.Spawn(std::move(work)); }) {}

void StepPipeline::Initialize() {
  for (Chunk& c : engine_.chunks_) {
    c.grads_copied.emplace(0);
    c.grads_reduced.emplace(0);
    c.reduce_queued.emplace(0);
    c.shard_sum_turn.emplace(1);
    c.params_gathered.emplace(0);
    if (!c.frozen()) ++trained_chunks_;
  }
  failed_ranks_.assign(size_t(engine_.ranks()), 0.0);
  for (size_t i = engine_.chunks_.size(); i-- > 0;) {
    if (!engine_.chunks_[i].frozen()) reduce_sequence_.push_back(i);
  }
  step_ = FreshStepState();
  boost::asio::post(engine_.loop_.executor(), [this] { ReadAhead(); });
}

StepPipeline::StepState StepPipeline::FreshStepState() const {
  return StepState{.grad_scale = 1.0 / engine_.ranks()};
}

bool StepPipeline::gated() const {
  return options_.optimizer.gradient_clipping > 0.0 || loss_scaler_.checks_overflow();
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
  for (size_t i = 0; i < engine_.chunks_.size(); ++i) {
    engine_.chunks_[i].steps_taken = chunk_steps[i];
  }
  engine_.m_.loss_scale->Set(loss_scaler_.scale());
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
  const Chunk& c = engine_.chunks_[chunk];
  const ChunkPhase phase = c.phase_now();
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
  for (size_t i = 0; i < engine_.chunks_.size(); ++i) {
    if (engine_.chunks_[i].micro_steps > 0) {
      return FailedPrecondition(operation + " while chunk " + std::to_string(i) +
                                " holds gradients of an unfinished step; call Step() first");
    }
  }
  return Status();
}

std::future<Result<StepReport>> StepPipeline::Step() {
  std::promise<Result<StepReport>> promise;
  std::future<Result<StepReport>> future = promise.get_future();
  bool delayed = false;
  {
    std::lock_guard lock(mutex_);
    Status refused;
    if (step_running_) refused = FailedPrecondition("Step() while the previous step is running");
    // A chunk gets gradients in every micro-step or in none (it is not updated this step).
    const std::vector<Chunk>& chunks = engine_.chunks_;
    for (size_t i = 0; i < chunks.size() && refused.ok(); ++i) {
      if (chunks[i].micro_steps != gas_ && chunks[i].micro_steps != 0) {
        refused = FailedPrecondition(
            "chunk " + std::to_string(i) + " received the gradients of " +
            std::to_string(chunks[i].micro_steps) + " of " + std::to_string(gas_) +
            " micro-steps; call GradsReady for a chunk in every micro-step of a step, or in "
            "none (then it is not updated)");
      }
    }
    if (refused.ok()) refused = CheckShardedStepLocked();
    if (refused.ok() && std::all_of(chunks.begin(), chunks.end(),
                                    [](const Chunk& c) { return c.micro_steps == 0; })) {
      // Some chunks may sit a step out, but a step without any gradients is a trainer's bug.
      refused =
          FailedPrecondition("Step() before any GradsReady: no chunk (chunk 0 to " +
                             std::to_string(chunks.size() - 1) + ") received gradients this step");
    }
    if (refused.ok()) {
      if (std::optional<size_t> held = engine_.residency_.FirstAcquired()) {
        refused = FailedPrecondition(
            "Step() while chunk " + std::to_string(*held) +
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
    delayed = hyper_.delayed;
  }
  // Several ranks: the norm's all-reduce, then the parameters' all-gathers, in the order every
  // rank reduced the gradients (CheckShardedStepLocked refused a step without every trained
  // chunk's). They run as their inputs come (see "Sharding" in the header).
  if (sharded()) EnqueueStepCollectives(reduce_sequence_);
  if (delayed) {
    // The trainer's next forward runs beside this step: it must find the device's parameters
    // complete (a failure shows again in the commit's own wait). The trainer waits here: a
    // stall. (Gradient buffers need nothing: Acquire waits for a chunk's gradient copy.)
    const auto start = Clock::now();
    engine_.device_.SynchronizeStream(Stream::kHostToDevice).IgnoreError();
    engine_.m_.stall_of(TrainerWait::kStep)
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
  }
  step_.requested = true;
  step_.promise.emplace(std::move(promise));
  step_.started = Clock::now();
  step_.used = 0;
  for (size_t i = 0; i < engine_.chunks_.size(); ++i) {
    if (engine_.chunks_[i].micro_steps > 0) {
      ++step_.used;
    } else if (!engine_.chunks_[i].frozen()) {
      // Sits this step out: the states it read ahead would hold a staging buffer that the
      // journeys of this step need.
      engine_.Spawn(preloader_.Drop(i));
    }
  }
  // Chunks without gradients this step are known now: a gated step may be decided. (Several
  // ranks decide through a collective, and every chunk has gradients.)
  if (gated() && !sharded() && !step_.decided && AllArrived()) Decide();
  // A retry after a failed attempt finishes what that attempt left (see step_pipeline.h).
  // (Several ranks do not retry, and their journeys update and gather each chunk themselves.)
  if (!sharded() && !step_.skip && (!gated() || step_.decided)) {
    for (size_t i = 0; i < engine_.chunks_.size(); ++i) {
      const ChunkPhase phase = engine_.chunks_[i].phase_now();
      if (engine_.chunks_[i].update_at_commit) continue;  // The commit's to update.
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
  Chunk& c = engine_.chunks_[chunk];
  {
    std::lock_guard lock(mutex_);
    c.MoveTo(ChunkPhase::kArrived);
  }
  ++step_.arrived;
  if (c.stats.all_finite) {
    step_.arrived_sum_of_squares += c.stats.sum_of_squares;
  } else {
    step_.arrived_non_finite = true;
  }
  if (!c.land_status.ok()) {
    KeepFirstError(
        c.land_status.WithContext("measuring the gradients of chunk " + std::to_string(chunk)));
  }
  if (!AllArrived()) return;
  if (sharded()) {
    all_arrived_.Open(Status());  // The norm's all-reduce may read every chunk's stats.
  } else if (gated() && !step_.decided) {
    Decide();
  }
}

bool StepPipeline::AllArrived() const {
  // Before Step() only every trained chunk arriving says so; frozen chunks never arrive.
  return step_.arrived == trained_chunks_ || (step_.requested && step_.arrived == step_.used);
}

StepPipeline::VerdictTotals StepPipeline::LocalTotals() const {
  // Sums go in chunk order so results are reproducible.
  VerdictTotals totals = {0.0, 0.0};
  for (const Chunk& each : engine_.chunks_) {
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
  if (step_.requested) return;
  step_.cancelled = true;
  gate_.Open();
  // Several ranks: without Step() no all-gather was enqueued, nor the reduce-scatter of a chunk
  // declared before its turn came; journeys that wait for one end.
  if (!sharded()) return;
  std::lock_guard lock(mutex_);
  const bool each_micro_step = engine_.reduces_each_micro_step();
  for (size_t i = 0; i < engine_.chunks_.size(); ++i) {
    Chunk& c = engine_.chunks_[i];
    const Status cancelled = Cancelled("the engine was destroyed before Step()");
    // The journeys that reduce: one per micro-step declared, or the last micro-step's.
    const int reducing = each_micro_step ? c.micro_steps : c.micro_steps == gas_ ? 1 : 0;
    for (int k = c.reduces_enqueued; k < reducing; ++k) {
      if (engine_.reduces_from_ring()) {
        // The journey learns from the number that no collective comes (ReduceGrads): a result
        // here would go to the first journey waiting, maybe an earlier micro-step's whose
        // collective is still running.
        c.reduce_numbers.push_back(Chunk::kNeverQueued);
        c.reduce_queued->Release();
      } else {
        c.reduce_results.push_back(cancelled);
        c.grads_reduced->Release();
      }
    }
    if (c.micro_steps != gas_) continue;
    c.gather_status = cancelled;
    c.params_gathered->Release();
  }
}

void StepPipeline::MaybeFinish() {
  if (!step_.requested || step_.committing || step_.finishing || step_.updates_running > 0) {
    return;
  }
  if (step_.speculations_open > 0) return;  // Updated ahead of the verdict, not yet resolved.
  const std::vector<Chunk>& chunks = engine_.chunks_;
  for (const Chunk& c : chunks) {
    if (c.phase_now() == ChunkPhase::kLanding) return;  // Gradients still landing.
  }
  // Several ranks: the norm's all-reduce and every chunk's all-gather are done too.
  if ((gated() || sharded()) && !step_.decided) return;
  if (sharded()) {
    for (const Chunk& c : chunks) {
      if (c.micro_steps > 0 && !c.gathered) return;
    }
  }
  if (!step_.error.ok()) {
    FinishStep(std::exchange(step_.error, Status()), /*completed=*/false);
    return;
  }
  if (!step_.skip) {
    for (const Chunk& c : chunks) {
      if (c.micro_steps == 0) continue;  // Not updated this step.
      const bool deferred = c.update_at_commit && c.phase_now() == ChunkPhase::kArrived;
      if (c.phase_now() != ChunkPhase::kUpdated && !deferred) return;  // A journey is on its way.
    }
  }
  step_.committing = true;
  engine_.Spawn(Commit());
}

Awaitable<void> StepPipeline::Commit() {
  Engine::Impl& e = engine_;
  std::vector<Chunk>& chunks = e.chunks_;
  const bool skipped = step_.skip;
  Status status;
  if (!skipped && !step_.committed) {
    // Device-kept chunks left for the commit (every one, in a transactional step; those the
    // trainer still held, otherwise) are updated now, after the trainer's use of them.
    status = e.residency_.OrderAfterTrainerUse(Stream::kCompute);
    for (size_t i = 0; i < chunks.size() && status.ok(); ++i) {
      Chunk& c = chunks[i];
      if (!c.update_at_commit || c.phase_now() != ChunkPhase::kArrived) continue;
      {
        std::lock_guard lock(mutex_);
        c.MoveTo(ChunkPhase::kUpdating);  // Claimed: a retry's Update leaves it alone.
      }
      status = co_await UpdateOnDevice(i);
      std::lock_guard lock(mutex_);
      c.MoveTo(status.ok() ? ChunkPhase::kUpdated : ChunkPhase::kArrived);
    }
    if (!status.ok()) {
      FinishStep(status.WithContext("updating the device's share of the optimizer states"),
                 /*completed=*/false);
      co_return;
    }
    // The point of no return: the shadows become current, host-home parameters swap.
    for (Chunk& c : chunks) {
      if (c.micro_steps == 0) continue;  // Not updated: its current state stays.
      if (c.placement.optimizer_states == Tier::kNvme) c.state_current = 1 - c.state_current;
      if (c.placement.params == Tier::kNvme) c.param_current = 1 - c.param_current;
      if (c.placement.params == Tier::kHost) std::swap(c.host_params, c.param_copy);
      if (c.states_in_shadow) {
        std::swap(c.host_states, c.host_state_shadow);
        c.states_in_shadow = false;
      }
    }
    step_.committed = true;
  }
  // Device-home parameters not uploaded yet go up behind the trainer's last use of every chunk;
  // one wait covers them, and that use, before stale device copies are dropped. A delayed step
  // holds its own back instead (below); those held back before went up by Step() at the latest.
  const bool delay = hyper_.delayed && !skipped;
  // (Not for a delayed step, which uploads nothing here: the next forward may be running, and
  // its releases must not hold the commit back.)
  if (!delay) status = e.residency_.OrderAfterTrainerUse(Stream::kHostToDevice);
  for (size_t i = 0; i < chunks.size() && status.ok() && !delay; ++i) {
    Chunk& c = chunks[i];
    if (c.placement.params != Tier::kDevice || c.micro_steps == 0) continue;
    if (skipped) {
      // A skipped step puts back only what a rolled-back speculation failed to restore.
      if (c.restore_params) status = co_await RestoreParameters(i);
      continue;
    }
    if (c.params_uploaded) continue;
    const size_t wbytes = c.working_bytes(e.working_size());
    status = e.device_.CopyToDevice(c.params.data(), c.param_copy.data(), wbytes);
    if (status.ok()) e.m_.h2d_bytes->Increment(double(wbytes));
  }
  const Status landed = co_await AwaitStream(e.device_, Stream::kHostToDevice);
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
    for (Chunk& c : chunks) {
      if (c.micro_steps == 0) continue;
      std::swap(c.param_copy, c.delayed_params);
      c.params_delayed = true;
    }
  }
  if (!skipped) {
    // The updated chunks' device copies are stale; the others' (frozen chunks, chunks without
    // gradients this step) still hold their parameters and stay.
    std::vector<size_t> updated;
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (chunks[i].micro_steps > 0) updated.push_back(i);
    }
    e.residency_.Drop(updated);
  }

  double norm = step_.grad_norm;
  if (!gated() && !sharded()) {
    double sum = 0.0;
    bool finite = true;
    for (const Chunk& c : chunks) {
      sum += c.stats.sum_of_squares;
      finite = finite && c.stats.all_finite;
    }
    norm = finite ? std::sqrt(sum) : std::nan("");  // As ApplyVerdict reports it.
  }
  bool stuck = false;
  {
    std::lock_guard lock(mutex_);
    stuck = skipped && loss_scaler_.AtMinimumScale();
    loss_scaler_.Update(skipped);
    if (!skipped) step_count_.fetch_add(1);
    for (Chunk& c : chunks) {
      if (c.micro_steps == 0) continue;  // Had no part in this step.
      if (!skipped) ++c.steps_taken;
      c.MoveTo(ChunkPhase::kIdle);
      c.micro_steps = 0;
      c.stats = {};
      c.land_status = Status();
      c.params_uploaded = false;
      c.restore_params = false;
      c.update_at_commit = false;
      c.gathered = false;
    }
    step_open_ = false;
  }
  e.m_.steps->Increment(skipped ? 0.0 : 1.0);
  e.m_.skipped_steps->Increment(skipped ? 1.0 : 0.0);
  e.m_.rolled_back_steps->Increment(step_.rolled_back ? 1.0 : 0.0);
  e.m_.loss_scale->Set(loss_scale());
  e.residency_.StepCommitted();
  ReadAhead();  // The next step's first states, read while its forward runs.
  const double seconds = std::chrono::duration<double>(Clock::now() - step_.started).count();
  e.m_.step_seconds->Set(seconds);
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
  step_.finishing = true;
  const Status local = result.status();
  step_.outcome.emplace(std::move(result));
  step_.outcome_completed = completed;
  step_outcome_.Open(local);
  if (step_.agreement) DeliverAgreedStep();
}

void StepPipeline::SetGradientsAside() {
  if (gas_ > 1) return;  // The updates read grads_sum.
  Engine::Impl& e = engine_;
  for (Chunk& c : e.chunks_) {
    // Landed in place (zero copy) and still to update: once the failure is delivered the
    // trainer may Acquire the chunk and write its gradient buffer, and the retry needs these.
    if (!e.ZeroCopy(c) || c.landed_grads == c.grads_landing.data() ||
        c.phase_now() != ChunkPhase::kArrived) {
      continue;
    }
    std::memcpy(c.grads_landing.data(), c.landed_grads, c.working_bytes(e.working_size()));
    c.landed_grads = c.grads_landing.data();
  }
}

void StepPipeline::DeliverStep(Result<StepReport> result, bool completed) {
  std::promise<Result<StepReport>> promise = std::move(*step_.promise);
  // The trainer cannot start the next forward before the step completes: all of it is a stall.
  // (A delayed step's next forward runs beside it: its stall is the next GradsReady's wait.)
  if (!hyper_.delayed) {
    engine_.m_.stall_of(TrainerWait::kStep)
        .Increment(std::chrono::duration<double>(Clock::now() - step_.started).count());
  }
  if (!completed) SetGradientsAside();
  if (completed) {
    if (result.ok()) engine_.m_.UpdateRates();
    step_ = FreshStepState();
    gate_.Reset();
  } else {
    step_.promise.reset();
    step_.requested = false;
    step_.committing = false;
    step_.finishing = false;
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
