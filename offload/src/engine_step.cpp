// Gradients and the step pipelines.
//
// A chunk's gradients leave the device as soon as backward declares them ready (GradsReady);
// LandGrads sums micro-steps and measures them; on the last micro-step the chunk "arrives". An
// arrived chunk is updated at once unless the step is gated: with gradient clipping or fp16
// overflow checks, every update waits for the global norm, i.e. for the last chunk. UpdateChunk
// is one chunk's journey (states NVMe->host, CPU optimizer, states host->NVMe, parameters
// host->device); journeys run concurrently, bounded by the staging buffers. When every chunk is
// updated, Commit makes the step visible at once (transactional placements) and completes
// Step()'s future.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "engine_impl.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

/// sum[i] (+)= grads[i] for i < numel, grads of `dtype` converted to fp32; `first` overwrites.
void AccumulateGrads(cpu_adam::CpuOptimizer& optimizer, float* sum, const void* grads, DType dtype,
                     size_t numel, bool first) {
  optimizer.ParallelFor(numel, [&](size_t begin, size_t end) {
    constexpr size_t kPiece = 4096;
    float converted[kPiece];
    for (size_t i = begin; i < end; i += kPiece) {
      const size_t n = std::min(kPiece, end - i);
      const float* values = converted;
      switch (dtype) {
        case DType::kFp32: values = static_cast<const float*>(grads) + i; break;
        case DType::kFp16:
          Fp16ToFp32({static_cast<const uint16_t*>(grads) + i, n}, {converted, n});
          break;
        case DType::kBf16:
          Bf16ToFp32({static_cast<const uint16_t*>(grads) + i, n}, {converted, n});
          break;
      }
      if (first) {
        std::memcpy(sum + i, values, n * sizeof(float));
      } else {
        for (size_t k = 0; k < n; ++k) sum[i + k] += values[k];
      }
    }
  });
}

/// AdamW's and Adam's hyper-parameters, which have the same fields, from the options.
template <typename HyperParams>
HyperParams AdamFamily(const OptimizerOptions& o, double lr, int64_t step, double grad_scale) {
  return {.lr = lr,
          .beta1 = o.beta1,
          .beta2 = o.beta2,
          .eps = o.eps,
          .weight_decay = o.weight_decay,
          .bias_correction = o.bias_correction,
          .step = step,
          .grad_scale = grad_scale};
}

}  // namespace

bool Engine::Impl::gated() const {
  return options_.optimizer.gradient_clipping > 0.0 || loss_scaler_.checks_overflow();
}

Status Engine::Impl::GradsReady(size_t chunk) {
  if (chunk >= chunks_.size()) {
    return InvalidArgument("chunk " + std::to_string(chunk) + " does not exist");
  }
  const int gas = options_.optimizer.gradient_accumulation_steps;
  std::lock_guard lock(mutex_);
  Chunk& c = chunks_[chunk];
  if (c.pins == 0) {
    return FailedPrecondition("GradsReady(" + std::to_string(chunk) +
                              ") on a chunk that is not acquired; call it before Release");
  }
  if (step_running_) {
    return FailedPrecondition("GradsReady(" + std::to_string(chunk) + ") while a step is running");
  }
  if (c.micro_steps >= gas) {
    return FailedPrecondition("chunk " + std::to_string(chunk) + " already received the " +
                              "gradients of all " + std::to_string(gas) +
                              " micro-steps of this step; call Step() first");
  }
  const int micro_step = c.micro_steps + 1;
  const bool last = micro_step == gas;
  Status queued;
  if (c.placement.optimizer_states == Tier::kDevice) {
    // The device keeps and updates this chunk: sum and measure its gradients in stream order.
    queued = device_.LaunchHostFunction(Stream::kCompute, [this, chunk, micro_step, last] {
      Chunk& ch = chunks_[chunk];
      GradsLanded(ch, last,
                  SumAndMeasure(static_cast<float*>(ch.device_grads_sum.data()), ch.grads.data(),
                                ch.numel, micro_step, last));
      if (last) {
        boost::asio::post(loop_.executor(), [this, chunk] {
          chunks_[chunk].micro_steps_landed = options_.optimizer.gradient_accumulation_steps;
          OnChunkArrived(chunk);
        });
      }
    });
  } else {
    queued = device_.RecordEvent(compute_marker_, Stream::kCompute);
    if (queued.ok()) queued = device_.StreamWaitEvent(Stream::kDeviceToHost, compute_marker_);
    if (queued.ok()) {
      queued = device_.CopyToHost(c.grads_landing.data(), c.grads.data(),
                                  c.working_bytes(working_size()), Stream::kDeviceToHost);
    }
    if (queued.ok()) {
      Gauge& copying = m_.in_flight_of(InFlightKind::kDeviceToHost);
      copying.Add(1.0);  // Before the copy can land and take it back.
      queued = device_.LaunchHostFunction(Stream::kDeviceToHost, [this, chunk, &copying] {
        copying.Add(-1.0);
        boost::asio::co_spawn(loop_.executor(), LandGrads(chunk), boost::asio::detached);
      });
      if (!queued.ok()) copying.Add(-1.0);
    }
  }
  if (!queued.ok()) {
    return queued.WithContext("queueing the gradients of chunk " + std::to_string(chunk));
  }
  c.micro_steps = micro_step;
  c.grads_in_flight = true;
  return Status();
}

Result<cpu_adam::GradientStats> Engine::Impl::SumAndMeasure(float* sum, const void* grads,
                                                            size_t numel, int micro_step,
                                                            bool last) {
  const bool summed = options_.optimizer.gradient_accumulation_steps > 1;
  if (summed) AccumulateGrads(*optimizer_, sum, grads, working_dtype(), numel, micro_step == 1);
  if (!last) return cpu_adam::GradientStats{};
  return summed ? optimizer_->ComputeGradientStats(sum, DType::kFp32, numel)
                : optimizer_->ComputeGradientStats(grads, working_dtype(), numel);
}

void Engine::Impl::GradsLanded(Chunk& c, bool last, const Result<cpu_adam::GradientStats>& stats) {
  std::lock_guard lock(mutex_);
  c.grads_in_flight = false;
  if (last) {
    c.land_status = stats.status();
    if (stats.ok()) c.stats = *stats;
  }
  cv_.notify_all();
}

Awaitable<void> Engine::Impl::LandGrads(size_t chunk) {
  Chunk& c = chunks_[chunk];
  const int gas = options_.optimizer.gradient_accumulation_steps;
  const int landed = ++c.micro_steps_landed;
  const bool last = landed == gas;
  m_.d2h_bytes->Increment(double(c.working_bytes(working_size())));
  auto sum_and_measure = [&] {
    return SumAndMeasure(reinterpret_cast<float*>(c.grads_sum.data()), c.grads_landing.data(),
                         c.numel, landed, last);
  };
  GradsLanded(c, last, co_await AwaitJob(jobs_, sum_and_measure));
  if (last) OnChunkArrived(chunk);
}

void Engine::Impl::OnChunkArrived(size_t chunk) {
  Chunk& c = chunks_[chunk];
  c.arrived = true;
  ++step_.chunks_arrived;
  if (!c.land_status.ok() && step_.error.ok()) {
    step_.error =
        c.land_status.WithContext("measuring the gradients of chunk " + std::to_string(chunk));
  }
  if (!gated()) {
    StartUpdate(chunk);
  } else if (step_.chunks_arrived == chunks_.size()) {
    // Every norm is in: decide the step. Sums go in chunk order so results are reproducible.
    double totals[2] = {0.0, 0.0};  // Sum of squares, count of non-finite chunks.
    for (const Chunk& each : chunks_) {
      if (each.stats.all_finite) {
        totals[0] += each.stats.sum_of_squares;
      } else {
        totals[1] += 1.0;
      }
    }
    Status reduced = environment_.communicator->AllReduceSum(totals);
    if (!reduced.ok() && step_.error.ok()) step_.error = reduced;
    const double scale = loss_scaler_.scale();
    step_.decided = true;
    step_.skip = loss_scaler_.checks_overflow() && totals[1] > 0.0;
    step_.grad_norm = step_.skip ? std::nan("") : std::sqrt(totals[0]) / scale;
    double clip = 1.0;
    const double max_norm = options_.optimizer.gradient_clipping;
    if (!step_.skip && max_norm > 0.0) {
      // DeepSpeed's and torch's clip_grad_norm_: scale by max_norm / (norm + 1e-6) when < 1.
      clip = std::min(1.0, max_norm / (step_.grad_norm + 1e-6));
    }
    step_.grad_scale = clip / scale;
    if (!step_.skip) {
      for (size_t i = 0; i < chunks_.size(); ++i) StartUpdate(i);
    }
  }
  MaybeFinish();
}

void Engine::Impl::StartUpdate(size_t chunk) {
  Chunk& c = chunks_[chunk];
  if (!step_.error.ok() || c.updated || c.updating) return;
  const bool on_device = c.placement.optimizer_states == Tier::kDevice;
  // Transactional steps update device-kept states only at the commit, when nothing can fail.
  if (on_device && transactional_) return;
  c.updating = true;
  ++step_.updates_running;
  boost::asio::co_spawn(
      loop_.executor(), on_device ? UpdateChunkOnDevice(chunk) : UpdateChunk(chunk),
      [this, chunk](std::exception_ptr /*never thrown*/, Status status) {
        Chunk& ch = chunks_[chunk];
        ch.updating = false;
        --step_.updates_running;
        if (status.ok()) {
          ch.updated = true;
        } else if (step_.error.ok()) {
          step_.error = status.WithContext("updating chunk " + std::to_string(chunk));
        }
        MaybeFinish();
      });
}

Status Engine::Impl::RunOptimizer(float* states, size_t numel, const void* grads, DType grad_dtype,
                                  void* param_copy, double grad_scale, int64_t step) {
  const OptimizerOptions& o = options_.optimizer;
  const double lr = lr_.load();
  const DType wdtype = working_dtype();
  const cpu_adam::StepBuffers buffers{
      .numel = numel,
      .params = states,
      .grads = grads,
      .grad_dtype = grad_dtype,
      .exp_avg = states + numel,
      .exp_avg_sq = states + 2 * numel,
      .param_copy = wdtype == DType::kFp32 ? nullptr : param_copy,
      .param_copy_dtype = wdtype == DType::kFp32 ? DType::kBf16 : wdtype};
  Status status;
  switch (o.type) {
    case OptimizerType::kAdamW:
      status = optimizer_->Step(AdamFamily<cpu_adam::AdamWHyperParams>(o, lr, step, grad_scale),
                                buffers);
      break;
    case OptimizerType::kAdam:
      status =
          optimizer_->Step(AdamFamily<cpu_adam::AdamHyperParams>(o, lr, step, grad_scale), buffers);
      break;
    case OptimizerType::kAdagrad:
      status = optimizer_->Step(cpu_adam::AdagradHyperParams{.lr = lr,
                                                             .weight_decay = o.weight_decay,
                                                             .eps = o.eps,
                                                             .step = step,
                                                             .grad_scale = grad_scale},
                                buffers);
      break;
    case OptimizerType::kLion:
      status = optimizer_->Step(cpu_adam::LionHyperParams{.lr = lr,
                                                          .beta1 = o.beta1,
                                                          .beta2 = o.beta2,
                                                          .weight_decay = o.weight_decay,
                                                          .grad_scale = grad_scale},
                                buffers);
      break;
  }
  if (status.ok() && wdtype == DType::kFp32 && param_copy != nullptr) {
    std::memcpy(param_copy, states, numel * sizeof(float));
  }
  return status;
}

Awaitable<Status> Engine::Impl::UpdateChunk(size_t chunk) {
  Chunk& c = chunks_[chunk];
  const size_t wbytes = c.working_bytes(working_size());
  const bool nvme_states = c.placement.optimizer_states == Tier::kNvme;
  const bool nvme_params = c.placement.params == Tier::kNvme;
  const int64_t step = step_count_.load() + 1;
  const double grad_scale = step_.grad_scale;
  const int gas = options_.optimizer.gradient_accumulation_steps;
  Status status;

  StagingBuffer state_buffer;
  float* states = reinterpret_cast<float*>(c.host_states.data());
  if (nvme_states) {
    if (!c.preload.active) StartPreload(chunk);
    {
      WaitTimer waiting(m_.wait_of(UpdateWait::kNvmeRead));
      co_await c.preload.ready->Acquire();
    }
    status = c.preload.status;
    state_buffer = std::move(c.preload.buffer);
    c.preload = {};
    states = reinterpret_cast<float*>(state_buffer.data());
  }
  StagingBuffer param_buffer;
  void* param_copy = c.param_copy.data();
  if (status.ok() && nvme_params) {
    {
      WaitTimer waiting(m_.wait_of(UpdateWait::kStagingBuffer));
      param_buffer = co_await param_staging_->Acquire();
    }
    param_copy = param_buffer.data();
  }
  if (status.ok()) {
    const void* grads = gas > 1 ? c.grads_sum.data() : c.grads_landing.data();
    const DType grad_dtype = gas > 1 ? DType::kFp32 : working_dtype();
    auto update = [&] {
      const auto start = Clock::now();
      Status s = RunOptimizer(states, c.numel, grads, grad_dtype, param_copy, grad_scale, step);
      m_.optimizer_seconds->Increment(std::chrono::duration<double>(Clock::now() - start).count());
      return s;
    };
    {
      OptimizerBusyGuard updating(m_);
      WaitTimer waiting(m_.wait_of(UpdateWait::kCpuOptimizer));
      status = co_await AwaitJob(jobs_, update);
    }
    if (status.ok()) m_.optimizer_params->Increment(double(c.numel));
  }
  // Write-behind into the shadow extents; the commit makes them current.
  std::optional<InFlightGuard> writing;
  std::optional<WaitTimer> write_time;
  if (status.ok() && (nvme_states || nvme_params)) {
    writing.emplace(m_.in_flight_of(InFlightKind::kNvmeWrite));
    write_time.emplace(m_.wait_of(UpdateWait::kNvmeWrite));
  }
  if (status.ok() && nvme_states) {
    const int registered = state_staging_registered_ ? int(state_buffer.index()) : -1;
    status = co_await nvme::AwaitSwapWrite(*swap_, c.state_extents[1 - c.state_current],
                                           state_buffer.data(), c.state_bytes(), registered);
    if (status.ok()) m_.nvme_write_bytes->Increment(double(c.state_bytes()));
  }
  if (status.ok() && nvme_params) {
    status = co_await nvme::AwaitSwapWrite(*swap_, c.param_extents[1 - c.param_current],
                                           param_buffer.data(), wbytes);
    if (status.ok()) m_.nvme_write_bytes->Increment(double(wbytes));
  }
  writing.reset();
  write_time.reset();
  if (state_staging_) state_staging_->Release(state_buffer);
  if (param_staging_) param_staging_->Release(param_buffer);
  // Nothing can fail after the update here, so the new parameters go up at once.
  if (status.ok() && !transactional_ && c.placement.params == Tier::kDevice) {
    status = device_.CopyToDevice(c.params.data(), c.param_copy.data(), wbytes);
    if (status.ok()) m_.h2d_bytes->Increment(double(wbytes));
  }
  co_return status;
}

Awaitable<Status> Engine::Impl::UpdateChunkOnDevice(size_t chunk) {
  Chunk& c = chunks_[chunk];
  const bool summed = options_.optimizer.gradient_accumulation_steps > 1;
  const void* grads = summed ? c.device_grads_sum.data() : c.grads.data();
  const DType grad_dtype = summed ? DType::kFp32 : working_dtype();
  const int64_t step = step_count_.load() + 1;
  const double grad_scale = step_.grad_scale;
  auto result = std::make_shared<Status>();
  Status queued = device_.LaunchHostFunction(
      Stream::kCompute, [this, &c, grads, grad_dtype, step, grad_scale, result] {
        *result = RunOptimizer(static_cast<float*>(c.device_states.data()), c.numel, grads,
                               grad_dtype, c.params.data(), grad_scale, step);
      });
  if (!queued.ok()) co_return queued;
  Status done = co_await AwaitStream(device_, Stream::kCompute);
  if (!done.ok()) co_return done;
  if (result->ok()) m_.device_optimizer_params->Increment(double(c.numel));
  co_return *result;
}

Awaitable<void> Engine::Impl::PreloadStates(size_t chunk) {
  Chunk& c = chunks_[chunk];
  ++preloads_running_;
  StagingBuffer buffer = co_await state_staging_->Acquire();
  const int registered = state_staging_registered_ ? int(buffer.index()) : -1;
  Status status;
  {
    InFlightGuard reading(m_.in_flight_of(InFlightKind::kNvmeRead));
    status = co_await nvme::AwaitSwapRead(*swap_, c.state_extents[c.state_current], buffer.data(),
                                          registered);
  }
  if (status.ok()) {
    m_.nvme_read_bytes->Increment(double(c.state_bytes()));
    c.preload.buffer = std::move(buffer);
  } else {
    state_staging_->Release(buffer);
  }
  c.preload.status = status;
  --preloads_running_;
  c.preload.ready->Release();
}

void Engine::Impl::StartPreloads() {
  if (!state_staging_) return;
  // Leave one staging buffer for a chunk that arrives out of the expected order.
  const int depth = std::max(1, options_.host.optimizer_buffer_count - 1);
  int started = 0;
  for (size_t i = chunks_.size(); i-- > 0 && started < depth;) {
    Chunk& c = chunks_[i];
    if (c.placement.optimizer_states != Tier::kNvme || c.preload.active) continue;
    StartPreload(i);
    ++started;
  }
}

void Engine::Impl::StartPreload(size_t chunk) {
  Chunk& c = chunks_[chunk];
  c.preload.active = true;
  c.preload.ready.emplace(0);
  boost::asio::co_spawn(loop_.executor(), PreloadStates(chunk), boost::asio::detached);
}

Awaitable<void> Engine::Impl::DropPreloads() {
  for (Chunk& c : chunks_) {
    if (!c.preload.active) continue;
    co_await c.preload.ready->Acquire();
    state_staging_->Release(c.preload.buffer);
    c.preload = {};
  }
}

void Engine::Impl::MaybeFinish() {
  if (!step_.requested || step_.committing || step_.updates_running > 0) return;
  if (step_.chunks_arrived < chunks_.size()) return;  // Gradients still landing.
  if (!step_.error.ok()) {
    Status error = std::exchange(step_.error, Status());
    FinishStep(error);
    return;
  }
  if (gated() && !step_.decided) return;
  if (!step_.skip) {
    for (const Chunk& c : chunks_) {
      const bool deferred = c.placement.optimizer_states == Tier::kDevice && transactional_;
      if (!c.updated && !deferred) return;
    }
  }
  step_.committing = true;
  boost::asio::co_spawn(loop_.executor(), Commit(), boost::asio::detached);
}

Awaitable<void> Engine::Impl::Commit() {
  Status status;
  if (!step_.skip && transactional_) {
    for (size_t i = 0; i < chunks_.size() && status.ok(); ++i) {
      if (chunks_[i].placement.optimizer_states == Tier::kDevice && !chunks_[i].updated) {
        status = co_await UpdateChunkOnDevice(i);
        if (status.ok()) chunks_[i].updated = true;
      }
    }
  }
  if (!status.ok()) {
    step_.committing = false;
    FinishStep(status.WithContext("updating the device's share of the optimizer states"));
    co_return;
  }
  if (!step_.skip) {
    std::lock_guard lock(mutex_);
    for (Chunk& c : chunks_) {
      if (c.placement.optimizer_states == Tier::kNvme) c.state_current = 1 - c.state_current;
      if (c.placement.params == Tier::kNvme) c.param_current = 1 - c.param_current;
      if (c.placement.params == Tier::kHost) std::swap(c.host_params, c.param_copy);
      if (transactional_ && c.placement.params == Tier::kDevice &&
          c.placement.optimizer_states != Tier::kDevice) {
        const size_t wbytes = c.working_bytes(working_size());
        if (status.ok())
          status = device_.CopyToDevice(c.params.data(), c.param_copy.data(), wbytes);
        if (status.ok()) m_.h2d_bytes->Increment(double(wbytes));
      }
    }
    DropOffloadedCopies();
  }
  // Every upload queued for this step (here or by UpdateChunk) lands before the step completes.
  if (status.ok()) status = co_await AwaitStream(device_, Stream::kHostToDevice);
  if (!status.ok()) {
    // Only a device that refuses to queue a copy gets here; the step is committed on the host
    // side, so report it as an internal failure rather than pretend to roll back.
    step_.committing = false;
    FinishStep(Internal("step committed but its parameters could not reach the device: " +
                        status.ToString()));
    co_return;
  }

  const bool skipped = step_.skip;
  double norm = step_.grad_norm;
  if (!gated()) {
    double sum = 0.0;
    for (const Chunk& c : chunks_) sum += c.stats.sum_of_squares;
    norm = std::sqrt(sum);
  }
  loss_scaler_.Update(skipped);
  if (!skipped) step_count_.fetch_add(1);
  m_.steps->Increment(skipped ? 0.0 : 1.0);
  m_.skipped_steps->Increment(skipped ? 1.0 : 0.0);
  m_.loss_scale->Set(loss_scaler_.scale());
  {
    std::lock_guard lock(mutex_);
    for (Chunk& c : chunks_) {
      c.micro_steps = 0;
      c.micro_steps_landed = 0;
      c.arrived = false;
      c.updated = false;
      c.stats = {};
      c.land_status = Status();
    }
    recording_ = false;
    order_position_ = 0;
  }
  StartPreloads();  // The next step's first states, read while its forward runs.
  const double seconds = std::chrono::duration<double>(Clock::now() - step_.started).count();
  m_.step_seconds->Set(seconds);
  StepReport report{.step = step_count_.load(),
                    .skipped = skipped,
                    .grad_norm = norm,
                    .loss_scale = loss_scaler_.scale(),
                    .seconds = seconds};
  FinishStep(report);
}

void Engine::Impl::FinishStep(Result<StepReport> result) {
  std::promise<Result<StepReport>> promise = std::move(*step_.promise);
  // The trainer cannot start the next forward before the step completes: all of it is a stall.
  m_.stall_of(TrainerWait::kStep)
      .Increment(std::chrono::duration<double>(Clock::now() - step_.started).count());
  if (result.ok()) {
    m_.UpdateRates();
    step_ = StepState{};
  } else {
    step_.promise.reset();
    step_.requested = false;
    step_.committing = false;
  }
  {
    std::lock_guard lock(mutex_);
    step_running_ = false;
    cv_.notify_all();
  }
  promise.set_value(std::move(result));
}

std::future<Result<StepReport>> Engine::Impl::Step() {
  std::promise<Result<StepReport>> promise;
  std::future<Result<StepReport>> future = promise.get_future();
  const int gas = options_.optimizer.gradient_accumulation_steps;
  {
    std::lock_guard lock(mutex_);
    Status refused;
    if (step_running_) refused = FailedPrecondition("Step() while the previous step is running");
    for (size_t i = 0; i < chunks_.size() && refused.ok(); ++i) {
      if (chunks_[i].micro_steps != gas) {
        refused = FailedPrecondition(
            "chunk " + std::to_string(i) + " received the gradients of " +
            std::to_string(chunks_[i].micro_steps) + " of " + std::to_string(gas) +
            " micro-steps; call GradsReady for every chunk in every micro-step before Step()");
      }
    }
    if (!refused.ok()) {
      promise.set_value(refused);
      return future;
    }
    step_running_ = true;
  }
  boost::asio::post(loop_.executor(), [this, promise = std::move(promise)]() mutable {
    step_.requested = true;
    step_.promise.emplace(std::move(promise));
    step_.started = Clock::now();
    // A retry after a failed attempt restarts the chunks that did not finish.
    if (!gated() || step_.decided) {
      for (size_t i = 0; i < chunks_.size(); ++i) {
        if (chunks_[i].arrived && !step_.skip) StartUpdate(i);
      }
    }
    MaybeFinish();
  });
  return future;
}

}  // namespace strata::offload
