// The gradient path: GradsReady queues a chunk's gradients off the device behind the trainer's
// work, and the landing sums micro-steps and measures the last one (squares and finiteness, for
// clipping and fp16 overflow checks). Landing holds a pin on the chunk's gradient buffer, so the
// next micro-step's Acquire waits until the buffer is free to overwrite. (Several ranks reduce
// first and measure their shard: step_sharded.cpp.)
#include <algorithm>
#include <chrono>
#include <cstring>

#include "step/chunk_step.h"
#include "step/step_engine.h"
#include "step/step_pipeline.h"

namespace strata::offload {
namespace {

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

}  // namespace

Status StepPipeline::GradsReady(size_t chunk, TrainerStream stream) {
  StepEngine& e = engine_;
  std::unique_lock lock(mutex_);
  ChunkStep& s = steps_[chunk];
  if (hyper_.delayed && !StepDone()) {
    // The previous step updates beside this step's forward; the gradients of this one land
    // where that update reads its own, so they wait for it to complete (a failed one is
    // refused below: Step() again retries it).
    const auto start = std::chrono::steady_clock::now();
    step_done_.wait(lock, [this] { return StepDone(); });
    e.metrics().stall_of(TrainerWait::kStep)
        .Increment(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  if (step_running_) {
    return FailedPrecondition("GradsReady(" + std::to_string(chunk) + ") while a step is running");
  }
  if (attempt_failed_) {
    // The failed step's verdict (norm, overflow) is made without this chunk.
    return FailedPrecondition(
        "GradsReady(" + std::to_string(chunk) + ") after a failed step; " +
        (e.sharded() ? std::string("with several ranks it cannot be retried: restart the ranks")
                     : std::string("call Step() again to retry it first")));
  }
  if (s.micro_steps >= gas_) {
    return FailedPrecondition("chunk " + std::to_string(chunk) + " already received the " +
                              "gradients of all " + std::to_string(gas_) +
                              " micro-steps of this step; call Step() first");
  }
  const int micro_step = s.micro_steps + 1;
  const bool last = micro_step == gas_;
  if (e.reduces_each_micro_step() && micro_step > 1) {
    STRATA_RETURN_IF_ERROR(WaitForLandingLocked(chunk, micro_step, lock));
  }
  STRATA_ASSIGN_OR_RETURN(ChunkView view, e.residency().PinGrads(chunk));
  if (Status queued = QueueLanding(chunk, view, stream, micro_step, last); !queued.ok()) {
    // A copy queued before the refusal may still be reading the gradient buffer.
    e.device().SynchronizeStream(Stream::kDeviceToHost).IgnoreError();
    e.residency().UnpinGrads(chunk);
    return queued.WithContext("queueing the gradients of chunk " + std::to_string(chunk));
  }
  if (!step_open_) {
    const OptimizerOptions& o = options_.optimizer;
    hyper_ = {.lr = next_lr_,
              .delayed = o.delayed_update && step_count_.load() >= o.delayed_update_from_step};
    step_open_ = true;
    reduces_enqueued_ = 0;
    all_arrived_.Reset();
  }
  // Closed only now that this landing is sure to come: a refusal above leaves it open for the
  // trainer's next try.
  if (e.reduces_each_micro_step()) s.landing_taken.Reset();
  if (micro_step == 1) s.reduces_enqueued = 0;
  s.micro_steps = micro_step;
  s.MoveTo(last ? ChunkPhase::kLanding : ChunkPhase::kAccumulating);
  // Several ranks: the chunk's reduce-scatter (each micro-step's, or the last's), in its turn.
  if (e.sharded()) DeclareReduceLocked(chunk, last);
  e.Spawn(last ? Journey(chunk, micro_step) : LandMicroStep(chunk, micro_step));
  return Status();
}

Status StepPipeline::QueueLanding(size_t chunk, const ChunkView& view, TrainerStream stream,
                                  int micro_step, bool last) {
  StepEngine& e = engine_;
  Chunk& c = e.chunks()[chunk];
  ChunkStep& s = steps_[chunk];
  // Posted to the loop by a stream thread when the gradients are where the landing reads them.
  auto landed = [&e, &s] {
    boost::asio::post(e.loop().executor(), [&s] { s.grads_copied->Release(); });
  };
  // Everything below runs after the trainer's work so far on its stream: backward.
  STRATA_RETURN_IF_ERROR(RecordTrainerEvent(e.device(), e.compute_marker(), stream));
  if (c.placement.optimizer_states == Tier::kDevice) {
    if (stream.native != nullptr) {
      STRATA_RETURN_IF_ERROR(e.device().StreamWaitEvent(Stream::kCompute, e.compute_marker()));
    }
    // The device keeps and updates this chunk: it sums and measures in stream order.
    return e.device().LaunchHostFunction(Stream::kCompute, [this, &c, &s, view, micro_step, last,
                                                           landed] {
      Result<cpu_adam::GradientStats> stats = SumAndMeasure(
          static_cast<float*>(c.device_grads_sum.data()), view.grads, c.numel, micro_step, last);
      if (last) {
        s.land_status = stats.status();
        if (stats.ok()) s.stats = *stats;
      }
      landed();
    });
  }
  STRATA_RETURN_IF_ERROR(e.device().StreamWaitEvent(Stream::kDeviceToHost, e.compute_marker()));
  if (e.ZeroCopy(c)) {
    // The landing reads them where backward wrote them, once backward is done (the host
    // function below): the trainer cannot write them again before the step completes, since
    // Acquire refuses the chunk until then.
    s.landed_grads = static_cast<const std::byte*>(view.grads);
    return e.device().LaunchHostFunction(Stream::kDeviceToHost, landed);
  }
  STRATA_RETURN_IF_ERROR(e.device().CopyToHost(c.grads_landing.data(), view.grads,
                                              c.working_bytes(e.working_size()),
                                              Stream::kDeviceToHost));
  s.landed_grads = c.grads_landing.data();
  Gauge& copying = e.metrics().in_flight_of(InFlightKind::kDeviceToHost);
  copying.Add(1.0);  // Before the copy can land and take it back.
  Status queued = e.device().LaunchHostFunction(Stream::kDeviceToHost, [&copying, landed] {
    copying.Add(-1.0);
    landed();
  });
  if (!queued.ok()) copying.Add(-1.0);
  return queued;
}

Result<cpu_adam::GradientStats> StepPipeline::SumAndMeasure(float* sum, const void* grads,
                                                            size_t numel, int micro_step,
                                                            bool last) {
  cpu_adam::CpuOptimizer& optimizer = engine_.cpu();
  const DType dtype = engine_.working_dtype();
  if (gas_ > 1) AccumulateGrads(optimizer, sum, grads, dtype, numel, micro_step == 1);
  // Several ranks measure this rank's shard of the sum over ranks, once reduced (ReduceGrads);
  // without accumulation they widen the gradients into the ReduceRing only when their
  // reduce-scatter's turn comes.
  if (!last || engine_.sharded()) return cpu_adam::GradientStats{};
  // Rechecking (gas_ is 1 then), the checksum Step() compares the trainer's buffer with.
  return gas_ > 1 ? optimizer.ComputeGradientStats(sum, DType::kFp32, numel)
                  : optimizer.ComputeGradientStats(grads, dtype, numel, rechecks());
}

void StepPipeline::SumGrads(float* sum, const void* grads, DType dtype, size_t numel, bool first) {
  AccumulateGrads(engine_.cpu(), sum, grads, dtype, numel, first);
}

Awaitable<Status> StepPipeline::LandGrads(size_t chunk, int micro_step, bool last) {
  StepEngine& e = engine_;
  Chunk& c = e.chunks()[chunk];
  ChunkStep& s = steps_[chunk];
  co_await s.grads_copied->Acquire();
  const bool read_on_host = c.placement.optimizer_states != Tier::kDevice;
  if (read_on_host && !e.ZeroCopy(c)) {
    e.metrics().d2h_bytes->Increment(double(c.working_bytes(e.working_size())));
  }
  // Reducing every micro-step, the landed gradients go to the reduce-scatter as they are
  // (ReduceGrads); nothing to sum or measure here.
  if (read_on_host && !e.reduces_each_micro_step()) {
    auto sum_and_measure = [&] {
      return SumAndMeasure(reinterpret_cast<float*>(c.grads_sum.data()), s.landed_grads, c.numel,
                           micro_step, last);
    };
    Result<cpu_adam::GradientStats> stats =
        co_await AwaitJob(e.jobs(), sum_and_measure, &e.jobs_in_flight());
    if (last) {
      s.land_status = stats.status();
      if (stats.ok()) s.stats = *stats;
    }
  }
  // The gradient buffer has been read: backward may write the next micro-step's.
  e.residency().UnpinGrads(chunk);
  co_return last ? s.land_status : Status();
}

Awaitable<void> StepPipeline::LandMicroStep(size_t chunk, int micro_step) {
  co_await LandGrads(chunk, micro_step, /*last=*/false);
  if (engine_.reduces_each_micro_step()) co_await ReduceGrads(chunk, micro_step);
}

}  // namespace strata::offload
