// A chunk's journey through a step, from its last micro-step's gradients to "staged for the
// commit": land, wait for the gate, read the states, step them, write them back, and send the
// new working parameters toward the device. See step_pipeline.h for the picture.
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "step/chunk_step.h"
#include "step/step_engine.h"
#include "step/step_pipeline.h"
#include "strata/nvme/async_io.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

Awaitable<void> StepPipeline::Journey(size_t chunk, int micro_step) {
  co_await LandGrads(chunk, micro_step, /*last=*/true);
  if (sharded()) co_await ReduceGrads(chunk, micro_step);
  Arrive(chunk);
  if (gated()) {
    if (CanSpeculate(chunk)) co_await Update(chunk, /*speculative=*/true);
    co_await gate_.Wait();
    if (steps_[chunk].speculated) co_await ResolveSpeculation(chunk);
  }
  if (!step_.skip && step_.progress != StepProgress::kCancelled) co_await Update(chunk);
  if (sharded()) co_await GatherParams(chunk);
  MaybeFinish();
}

bool StepPipeline::CanSpeculate(size_t chunk) const {
  if (!engine_.Speculates() || step_.decided || step_.progress == StepProgress::kCancelled) {
    return false;
  }
  // Rechecking, a chunk that arrives after Step() was called has its verdict a moment away.
  if (rechecks() && Requested(step_.progress)) return false;
  // A speculation the verdict is sure to roll back is work thrown away: the step overflows, or
  // the norm of the gradients arrived so far (it only grows) already needs clipping.
  if (loss_scaler_.checks_overflow() && step_.arrived_non_finite) return false;
  if (ClipCoefficient(std::sqrt(step_.arrived_sum_of_squares) / loss_scale()) < 1.0) return false;
  const Chunk& c = engine_.chunks()[chunk];
  const Tier states = *c.placement.optimizer_states;
  return states == Tier::kNvme || (states == Tier::kHost && !c.host_state_shadow.empty());
}

Awaitable<void> StepPipeline::Update(size_t chunk, bool speculative) {
  StepEngine& e = engine_;
  Chunk& c = e.chunks()[chunk];
  ChunkStep& s = steps_[chunk];
  const ChunkPhase from = s.phase_now();
  // Only one update per chunk at a time, and only where one is left to do (a retry may race
  // the journey resumed by the gate: whoever comes first updates).
  if (from != ChunkPhase::kArrived && from != ChunkPhase::kStepped) co_return;
  // Left to the commit, or the commit has begun: it updates what is left, not a late journey.
  // (CommitBegun counts several ranks' wait for each other's outcome too, which comes after
  // every chunk's journey, so no late journey meets it.)
  if (s.update_at_commit || CommitBegun(step_.progress)) co_return;
  // This attempt failed already, or failed and ended: Step() again retries.
  if (!step_.error.ok() || attempt_failed_) co_return;
  const bool on_device = c.placement.optimizer_states == Tier::kDevice;
  if (on_device) {
    // Device-kept states are stepped in place, with nothing to undo them by: where a step can
    // fail after its updates (states or parameters on NVMe), they are updated at the commit,
    // once everything else has succeeded.
    // Otherwise the device's optimizer rewrites the chunk's parameters in place now, after the
    // trainer's last use of them, or at the commit while the trainer still holds the chunk.
    bool now = !e.transactional();
    if (now) {
      Result<bool> released = e.residency().OrderAfterTrainerUse(chunk, Stream::kCompute);
      if (!released.ok()) {
        KeepFirstError(released.status());
        co_return;
      }
      now = *released;
    }
    if (!now) {
      s.update_at_commit = true;
      co_return;
    }
  }
  {
    std::lock_guard lock(mutex_);
    s.MoveTo(ChunkPhase::kUpdating);
  }
  ++step_.updates_running;
  if (speculative) {
    s.speculated = true;
    ++step_.speculations_open;
    e.metrics().speculative_updates->Increment(1.0);
  }
  Status status;
  bool stepped = false;
  if (on_device) {
    status = co_await UpdateOnDevice(chunk);
  } else {
    status = co_await UpdateOnHost(chunk, /*republish=*/from == ChunkPhase::kStepped, speculative,
                                   stepped);
  }
  --step_.updates_running;
  {
    std::lock_guard lock(mutex_);
    s.MoveTo(status.ok() ? ChunkPhase::kUpdated
             : stepped   ? ChunkPhase::kStepped
                         : ChunkPhase::kArrived);
  }
  if (!status.ok()) KeepFirstError(status.WithContext("updating chunk " + std::to_string(chunk)));
}

Awaitable<void> StepPipeline::ResolveSpeculation(size_t chunk) {
  StepEngine& e = engine_;
  ChunkStep& s = steps_[chunk];
  s.speculated = false;
  // The verdict decides what goes up from here: the kept update's parameters (below), or what
  // the master rounds to; a Release meanwhile sends neither.
  s.upload_at_release = false;
  const bool updated = s.phase_now() == ChunkPhase::kUpdated;  // Not if the update failed.
  const bool kept = !step_.skip && !step_.clipped && step_.progress != StepProgress::kCancelled &&
                    !s.grads_changed;
  if (updated && kept) {
    // The update stands; parameters that waited for the verdict go up now.
    if (Status uploaded = UploadEarly(chunk); !uploaded.ok()) {
      KeepFirstError(
          uploaded.WithContext("uploading the parameters of chunk " + std::to_string(chunk)));
    }
  } else if (updated) {
    // The update wrote its states elsewhere — a staging buffer and the NVMe shadow extent, or
    // the host shadow buffer — and left the current ones as they were: dropping it is all it
    // takes.
    s.states_in_shadow = false;
    step_.rolled_back = true;
    e.metrics().rolled_back_updates->Increment(1.0);
    if (s.params_uploaded) {
      // The device has the speculative parameters (they go up early). Put back what the
      // current master rounds to, which is what it held before, so that however this attempt
      // ends the device never keeps an update the verdict rolled back; a redo uploads its own
      // after. If that upload fails, the commit of a skipped step (or the redo) makes it.
      if (Status restored = co_await RestoreParameters(chunk); !restored.ok()) {
        KeepFirstError(
            restored.WithContext("restoring the parameters of chunk " + std::to_string(chunk)));
      }
    }
    // Only now open to a redo: one started meanwhile (Step()'s, for chunks in kArrived) would
    // write param_copy under the put-back, which would then overwrite the redo's parameters.
    std::lock_guard lock(mutex_);
    s.MoveTo(ChunkPhase::kArrived);
  }
  --step_.speculations_open;
}

Awaitable<Status> StepPipeline::RestoreParameters(size_t chunk) {
  StepEngine& e = engine_;
  Chunk& c = e.chunks()[chunk];
  ChunkStep& s = steps_[chunk];
  // The speculative upload has read param_copy once the stream is through it.
  Status status = co_await AwaitStream(e.device(), Stream::kHostToDevice);
  // The current master, rounded: from host memory, or kept in params_before by the update of
  // NVMe-kept states (only those with it upload speculatively).
  auto round = [&e, &c] {
    if (c.placement.optimizer_states == Tier::kNvme) {
      std::memcpy(c.param_copy.data(), c.params_before.data(), c.working_bytes(e.working_size()));
    } else {
      Fp32ToDType({reinterpret_cast<const float*>(c.host_states.data()), c.numel},
                  e.working_dtype(), c.param_copy.data());
    }
  };
  co_await AwaitJob(e.jobs(), round, &e.jobs_in_flight());  // What any later upload must send.
  s.params_uploaded = false;
  if (status.ok()) status = UploadEarly(chunk);
  // Read before a redo rewrites param_copy.
  if (status.ok()) status = co_await AwaitStream(e.device(), Stream::kHostToDevice);
  s.params_uploaded = false;  // Not this step's parameters: a redo or the commit sends those.
  s.upload_at_release = false;
  s.restore_params = !status.ok();
  co_return status;
}

ChunkUpdate StepPipeline::UpdateOf(size_t chunk, float* states, float* states_out,
                                   const void* grads, DType grad_dtype, void* param_copy,
                                   double grad_scale) const {
  const Chunk& c = engine_.chunks()[chunk];
  return {.optimizer = &options_.optimizer,
          .segments = c.segments,
          .numel = c.shard.numel(),  // The elements this rank updates.
          .states = states,
          .states_out = states_out,
          .grads = grads,
          .grad_dtype = grad_dtype,
          .param_copy = param_copy,
          .working_dtype = engine_.working_dtype(),
          .lr = hyper_.lr,
          .step = steps_[chunk].steps_taken + 1,
          .grad_scale = grad_scale};
}

Awaitable<Status> StepPipeline::UpdateOnHost(size_t chunk, bool republish, bool speculative,
                                             bool& stepped) {
  StepEngine& e = engine_;
  Chunk& c = e.chunks()[chunk];
  ChunkStep& step = steps_[chunk];
  EngineMetrics& m = e.metrics();
  const size_t home_bytes = c.param_home_bytes(e.working_size());  // Stage 3: the shard.
  const bool nvme_states = c.placement.optimizer_states == Tier::kNvme;
  const bool nvme_params = c.placement.params == Tier::kNvme;
  // Ahead of the verdict: the scale of a step that neither clips (coefficient 1) nor overflows,
  // computed as Decide computes it, so that a verdict that agrees gives the same bits.
  const double grad_scale = speculative ? 1.0 / loss_scale() : step_.grad_scale;
  Status status;
  stepped = republish;

  StagingBuffer state_buffer;
  float* states = reinterpret_cast<float*>(c.host_states.data());
  // Host-home states are stepped in place, except ahead of the verdict: then the update writes
  // them into the shadow buffer and leaves the current ones for a roll-back.
  float* states_out =
      speculative && !nvme_states ? reinterpret_cast<float*>(c.host_state_shadow.data()) : states;
  if (nvme_states) {
    {
      WaitTimer waiting(m.wait_of(UpdateWait::kNvmeRead));
      Result<StagingBuffer> read = co_await preloader_.Take(chunk);
      if (read.ok()) {
        state_buffer = std::move(*read);
      } else {
        status = read.status();
      }
    }
    states = reinterpret_cast<float*>(state_buffer.data());
    states_out = states;
  }
  StagingBuffer param_buffer;
  // This rank's shard of the new parameters (the whole chunk with one rank); the all-gather
  // brings the other ranks' shards (GatherParams), or with stage 3 the next Acquire does, from
  // a param_copy that holds the shard alone.
  void* param_copy =
      c.param_copy.data() + (c.params_sharded ? 0 : c.shard.begin * e.working_size());
  bool in_place = false;
  if (status.ok()) in_place = co_await ClaimParamsInPlace(chunk, speculative);
  if (in_place) param_copy = c.params.data();
  if (status.ok() && nvme_params) {
    {
      WaitTimer waiting(m.wait_of(UpdateWait::kStagingBuffer));
      param_buffer = co_await e.param_staging()->Acquire();
    }
    param_copy = param_buffer.data();
  }
  // The optimizer, then the checksums of what goes to NVMe: both on a job, off the loop.
  uint64_t state_checksum = 0;
  uint64_t param_checksum = 0;
  if (status.ok()) {
    const void* grads = sharded()  ? c.grads_shard.data()
                        : gas_ > 1 ? c.grads_sum.data()
                                   : step.landed_grads;
    const DType grad_dtype = sharded() || gas_ > 1 ? DType::kFp32 : e.working_dtype();
    auto update = [&] {
      Status s;
      if (republish) {
        // The states already hold this step: only the working parameters are made again.
        Fp32ToDType({states, c.shard.numel()}, e.working_dtype(), param_copy);
      } else {
        if (speculative && nvme_states && !c.params_before.empty()) {
          Fp32ToDType({states, c.numel}, e.working_dtype(), c.params_before.data());
        }
        const auto start = Clock::now();
        s = e.updaters().host().Update(
            UpdateOf(chunk, states, states_out, grads, grad_dtype, param_copy, grad_scale));
        m.optimizer_seconds->Increment(std::chrono::duration<double>(Clock::now() - start).count());
      }
      if (s.ok() && nvme_states) {
        state_checksum = e.swap()->Checksum(state_buffer.data(), c.state_bytes());
      }
      if (s.ok() && nvme_params)
        param_checksum = e.swap()->Checksum(param_buffer.data(), home_bytes);
      return s;
    };
    {
      OptimizerBusyGuard updating(m);
      WaitTimer waiting(m.wait_of(UpdateWait::kCpuOptimizer));
      status = co_await AwaitJob(e.jobs(), update, &e.jobs_in_flight());
    }
    if (status.ok() && !republish) m.optimizer_params->Increment(double(c.shard.numel()));
    // Host-home states stepped in place: from here on a failure must not step them again.
    stepped = !nvme_states && states_out == states && (republish || status.ok());
    // Stepped into the shadow: the commit makes them current, unless the verdict drops them.
    step.states_in_shadow = status.ok() && states_out != states;
  }
  // Write-behind into the shadow extents; the commit makes them current.
  std::optional<InFlightGuard> writing;
  std::optional<WaitTimer> write_time;
  if (status.ok() && (nvme_states || nvme_params)) {
    writing.emplace(m.in_flight_of(InFlightKind::kNvmeWrite));
    write_time.emplace(m.wait_of(UpdateWait::kNvmeWrite));
  }
  if (status.ok() && nvme_states) {
    status = co_await nvme::AwaitSwapWrite(
        *e.swap(), c.state_shadow(), state_buffer.data(), c.state_bytes(),
        preloader_.FixedBufferIndex(state_buffer), state_checksum);
    if (status.ok()) m.nvme_write_bytes->Increment(double(c.state_bytes()));
  }
  if (status.ok() && nvme_params) {
    status = co_await nvme::AwaitSwapWrite(*e.swap(), c.param_shadow(), param_buffer.data(),
                                           home_bytes, -1, param_checksum);
    if (status.ok()) m.nvme_write_bytes->Increment(double(home_bytes));
  }
  writing.reset();
  write_time.reset();
  if (nvme_states) {
    preloader_.Return(state_buffer);
    ReadAhead();  // The buffer reads ahead for a chunk to come.
  }
  if (e.param_staging()) e.param_staging()->Release(param_buffer);
  // Speculative parameters go up early too: ResolveSpeculation puts back what the device held
  // if the verdict rolls the update back (the master in host memory, rounded, or the NVMe-kept
  // chunk's params_before; one without waits for the verdict, as reading the states back would
  // cost more than the wait). Not when rechecking: the trainer may run another forward before
  // Step() (a longer accumulation window, a step it skips), which must find the parameters as
  // they were, so they wait for the verdict (ResolveSpeculation uploads them).
  // (Several ranks upload once the other shards are in: GatherParams.)
  const bool can_restore = !speculative || !nvme_states || !c.params_before.empty();
  const bool upload_now = !speculative || (can_restore && !rechecks());
  if (status.ok() && in_place) {
    step.params_uploaded = true;  // The optimizer wrote them into the device's.
    step.restore_params = false;
  } else if (status.ok() && upload_now && !sharded()) {
    status = UploadEarly(chunk);
  }
  // A speculative update that failed leaves the current states as they were: the retry's
  // verdict may want another scale.
  if (!status.ok()) step.states_in_shadow = false;
  co_return status;
}

Awaitable<bool> StepPipeline::ClaimParamsInPlace(size_t chunk, bool speculative) {
  StepEngine& e = engine_;
  const Chunk& c = e.chunks()[chunk];
  // Only an update that nothing after it can undo: host-kept states stepped in place (a failed
  // NVMe write would leave the device with parameters whose states did not commit), not ahead
  // of the verdict.
  if (!e.ZeroCopy(c) || speculative || c.placement.optimizer_states != Tier::kHost) co_return false;
  // The device's parameters are the trainer's until it has released the chunk (else the upload
  // waits, as a copy would: UploadEarly, the commit) and its work queued on them has run, which
  // the stream passes once it has (on a host-accessible device, at once or nearly: the
  // trainer's work is what its own thread did). Acquire refuses the chunk from its last
  // GradsReady until the step completes.
  Result<bool> released = e.residency().OrderAfterTrainerUse(chunk, Stream::kHostToDevice);
  if (!released.ok() || !*released) co_return false;
  const Status passed = co_await AwaitStream(e.device(), Stream::kHostToDevice);
  co_return passed.ok();
}

Status StepPipeline::UploadEarly(size_t chunk) {
  StepEngine& e = engine_;
  Chunk& c = e.chunks()[chunk];
  ChunkStep& s = steps_[chunk];
  // Device-home parameters go up as soon as their chunk's update is complete, behind the
  // trainer's last use of them; the commit uploads those the trainer still holds. A step that
  // fails later leaves these new: its retry does not update the chunk again, and the commit
  // makes its states (NVMe shadows included) current with them.
  if (c.placement.params != Tier::kDevice || s.params_uploaded) return Status();
  // A delayed step's parameters wait (the commit holds them back); so do a later step's while
  // older ones are still held back, which must reach the device first.
  if (hyper_.delayed) return Status();
  {
    std::lock_guard lock(mutex_);
    if (s.params_delayed) return Status();
  }
  STRATA_ASSIGN_OR_RETURN(const bool released,
                          e.residency().OrderAfterTrainerUse(chunk, Stream::kHostToDevice));
  // Still the trainer's: its Release sends them (UploadReleased), as early as they can go.
  s.upload_at_release = !released;
  if (!released) return Status();
  const size_t wbytes = c.working_bytes(e.working_size());
  STRATA_RETURN_IF_ERROR(e.device().CopyToDevice(c.params.data(), c.param_copy.data(), wbytes));
  e.metrics().h2d_bytes->Increment(double(wbytes));
  s.params_uploaded = true;
  s.restore_params = false;
  return Status();
}

void StepPipeline::Released(size_t chunk) {
  std::lock_guard lock(mutex_);
  const ChunkStep& s = steps_[chunk];
  // Not before this step's last GradsReady of the chunk: forward and the earlier micro-steps
  // still use the parameters.
  if (s.micro_steps != gas_) return;
  if (s.params_delayed) {
    // A failure leaves them held back: the next Step() tries again and reports it.
    if (!step_running_) UploadDelayedLocked(chunk).IgnoreError();
    return;
  }
  // An update done while the trainer held the chunk left its parameters for this Release
  // (ChunkStep::upload_at_release: the loop owns it, and only device-home parameters set it).
  // Spawned, not posted: the engine's destructor waits for spawned work before it synchronizes
  // the device and frees the buffers, so the upload cannot be queued after that.
  engine_.Spawn(UploadReleased(chunk));
}

Awaitable<void> StepPipeline::UploadReleased(size_t chunk) {
  ChunkStep& s = steps_[chunk];
  // Only what UploadEarly would have sent had the Release come first: an update still staged
  // (not rolled back, not committed: the commit uploads what is left, and a step that ended
  // cleared the flag).
  if (!s.upload_at_release || s.phase_now() != ChunkPhase::kUpdated ||
      CommitBegun(step_.progress)) {
    co_return;
  }
  if (Status uploaded = UploadEarly(chunk); !uploaded.ok()) {
    KeepFirstError(
        uploaded.WithContext("uploading the parameters of chunk " + std::to_string(chunk)));
  }
}

Awaitable<Status> StepPipeline::UpdateOnDevice(size_t chunk) {
  StepEngine& e = engine_;
  Chunk& c = e.chunks()[chunk];
  ChunkStep& s = steps_[chunk];
  const void* grads = gas_ > 1 ? c.device_grads_sum.data() : c.grads.data();
  const DType grad_dtype = gas_ > 1 ? DType::kFp32 : e.working_dtype();
  auto* states = static_cast<float*>(c.device_states.data());
  const ChunkUpdate update =
      UpdateOf(chunk, states, states, grads, grad_dtype, c.params.data(), step_.grad_scale);
  // The placement put states here only where an updater serves the device's memory.
  Updater* const device_updater = e.updaters().device();
  if (device_updater == nullptr) {
    co_return Internal("chunk " + std::to_string(chunk) +
                       " keeps its states on the device, which no updater serves");
  }
  Updater& updater = *device_updater;
  auto result = std::make_shared<Status>();
  // Behind the trainer's work on the compute stream (the gradients it wrote): queued there by
  // an updater of the device's own, or run from it on the CPU.
  Status queued = updater.queues_on_device()
                      ? updater.Update(update)
                      : e.device().LaunchHostFunction(Stream::kCompute, [&updater, update, result] {
                          *result = updater.Update(update);
                        });
  // Even when queuing failed: what was queued before the failure is done before anything
  // touches the chunk's states again (a retry).
  Status done = co_await AwaitStream(e.device(), Stream::kCompute);
  if (!queued.ok()) co_return queued;
  if (!done.ok()) co_return done;
  if (result->ok()) {
    e.metrics().device_optimizer_params->Increment(double(c.numel));
    s.params_uploaded = true;  // The kernel wrote the device's parameters itself.
  }
  co_return *result;
}

void StepPipeline::ReadAhead() {
  preloader_.Start(/*participants_known=*/Requested(step_.progress) &&
                   !CommitBegun(step_.progress));
}

}  // namespace strata::offload
