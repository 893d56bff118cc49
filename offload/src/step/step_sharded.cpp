// A step across several ranks (ZeRO stages 1, 2 and 3): the collectives of each chunk and of
// the step, enqueued on the trainer thread in one order on every rank, the journey's two waits
// on them, and the agreement on the step's outcome. (Stage 3's parameters are gathered at
// Acquire by ParamGather, not by the step's all-gathers.)
// See "Several ranks" in docs/architecture.md.
#include <algorithm>
#include <string>
#include <vector>

#include "step/chunk_step.h"
#include "step/step_engine.h"
#include "step/step_pipeline.h"

namespace strata::offload {

bool StepPipeline::sharded() const { return engine_.sharded(); }

bool StepPipeline::JourneyReadsReduceSlot() const {
  return engine_.quantizes_gradients() || engine_.reduces_each_micro_step();
}

Status StepPipeline::CheckShardedStepLocked() const {
  if (!sharded()) return Status();
  if (attempt_failed_) {
    return FailedPrecondition(
        "a failed step cannot be retried with the optimizer states sharded across " +
        std::to_string(engine_.ranks()) +
        " ranks: the ranks' states may differ; restart the ranks");
  }
  const std::vector<Chunk>& chunks = engine_.chunks();
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (!chunks[i].frozen() && steps_[i].micro_steps == 0) {
      return FailedPrecondition(
          "chunk " + std::to_string(i) + " received no gradients this step; with several ranks " +
          "every trained chunk needs them in every step (each rank reduces every chunk)");
    }
  }
  return Status();
}

void StepPipeline::DeclareReduceLocked(size_t chunk, bool last) {
  ChunkStep& s = steps_[chunk];
  if (last) {
    // Nothing of this step's last micro-step has touched the chunk's signals yet: its journey,
    // spawned next, opens them, maybe before its reduce-scatter is enqueued.
    s.grads_summed.Reset();
    s.shard_updated.Reset();
  }
  // Reduce-scatters go in one order on every rank, backward's (the last chunk first), whatever
  // order this rank's trainer declares gradients in: a chunk whose turn has not come waits for
  // the chunks before it. Ranks that matched collectives by arrival would sum one rank's chunk
  // with another's whenever their sizes agree. Reducing every micro-step, the order is that of
  // each micro-step in turn.
  const size_t per_round = reduce_sequence_.size();
  const size_t rounds = engine_.reduces_each_micro_step() ? size_t(gas_) : 1;
  while (reduces_enqueued_ < rounds * per_round) {
    const size_t next = reduce_sequence_[reduces_enqueued_ % per_round];
    const int micro_step = rounds == 1 ? gas_ : int(reduces_enqueued_ / per_round) + 1;
    if (steps_[next].micro_steps < micro_step) break;
    EnqueueReduceLocked(next);
  }
}

Status StepPipeline::WaitForLandingLocked(size_t chunk, int micro_step,
                                          std::unique_lock<std::mutex>& lock) {
  ChunkStep& s = steps_[chunk];
  if (s.reduces_enqueued < micro_step - 1) {
    const size_t waiting_for = reduce_sequence_[reduces_enqueued_ % reduce_sequence_.size()];
    return FailedPrecondition(
        "GradsReady(" + std::to_string(chunk) + ") of micro-step " + std::to_string(micro_step) +
        " before micro-step " + std::to_string(micro_step - 1) +
        "'s gradients of the chunk could be reduced: with ZeRO stage 2 or 3 and gradient "
        "accumulation the ranks reduce every micro-step's gradients in one chunk order (the last "
        "chunk first), so declare every trained chunk's gradients of a micro-step (chunk " +
        std::to_string(waiting_for) + "'s are next) before the next micro-step's");
  }
  // Its reduce-scatter is enqueued, so the landing is taken without anything more from this
  // thread: the wait ends. It is a stall only when the link is a micro-step behind.
  lock.unlock();
  {
    WaitTimer stalled(engine_.metrics().stall_of(TrainerWait::kCollective));
    s.landing_taken.Wait().IgnoreError();
  }
  lock.lock();
  return Status();
}

void StepPipeline::EnqueueReduceLocked(size_t chunk) {
  StepEngine& e = engine_;
  Chunk& c = e.chunks()[chunk];
  ChunkStep& s = steps_[chunk];
  ++reduces_enqueued_;
  ++s.reduces_enqueued;
  const bool ring = e.reduces_from_ring();
  const bool quantized = e.quantizes_gradients();
  const bool journey_reads = JourneyReadsReduceSlot();
  const uint64_t number = ring ? e.reduce_ring().Next() : ChunkStep::kNeverQueued;
  if (ring) {
    // The journey fills the slot when its turn comes (FillReduceSlot).
    boost::asio::post(e.loop().executor(), [&s, number] {
      s.reduce_numbers.push_back(number);
      s.reduce_queued->Release();
    });
  }
  auto ready = [&e, &s, ring, number] {
    return ring ? e.reduce_ring().WaitFilled(number) : s.grads_summed.Wait();
  };
  auto done = [&e, &s, ring, journey_reads, number](Status status) {
    boost::asio::post(e.loop().executor(),
                      [&e, &s, ring, journey_reads, number, status = std::move(status)] {
                        // Done reading the slot, whatever its outcome (unless the journey reads
                        // what the collective wrote: it releases the slot then).
                        if (ring && !journey_reads) e.reduce_ring().Release(number);
                        s.reduce_results.push_back(status);
                        s.grads_reduced->Release();
                      });
  };
  Communicator& comm = e.communicator();
  if (quantized) {
    // Each rank's partition of this rank's gradients, quantized, to that rank.
    const size_t bytes = cpu_adam::QuantizedBytes(c.shard.numel(), e.gradient_quant_bits());
    e.metrics().collective_of(CollectiveKind::kReduceScatter).Increment(double(bytes * size_t(e.ranks())));
    comm.AllToAll(e.reduce_ring().Sent(number), e.reduce_ring().Received(number),
                  bytes / sizeof(float), DType::kFp32, std::move(ready), std::move(done));
    return;
  }
  e.metrics().collective_of(CollectiveKind::kReduceScatter)
      .Increment(double(c.numel * DTypeSize(DType::kFp32)));
  const void* input =
      ring ? static_cast<const void*>(e.reduce_ring().Input(number)) : c.grads_sum.data();
  void* output = journey_reads ? static_cast<void*>(e.reduce_ring().Output(number))
                               : static_cast<void*>(c.grads_shard.data());
  comm.ReduceScatter(input, output, c.shard.numel(), DType::kFp32, ReduceOp::kSum, std::move(ready),
                     std::move(done));
}

void StepPipeline::EnqueueStepCollectives(const std::vector<size_t>& order) {
  StepEngine& e = engine_;
  Communicator& comm = e.communicator();
  // Every step's report has the global norm; a gated step's updates wait for it.
  comm.AllReduceScalars(
      verdict_totals_, ReduceOp::kSum,
      [this] {
        Status arrived = all_arrived_.Wait();
        // Every chunk's stats were written on the loop before it opened the signal.
        verdict_totals_ = LocalTotals();
        return arrived;
      },
      [this, &e](Status status) {
        boost::asio::post(e.loop().executor(), [this, status = std::move(status)] {
          if (!status.ok()) {
            KeepFirstError(status.WithContext("reducing the gradient norm across ranks"));
          }
          ApplyVerdict(verdict_totals_);  // Even failed: the journeys waiting for it end.
          MaybeFinish();
        });
      });
  const size_t wsize = e.working_size();
  step_outcome_.Reset();  // The last step's was delivered before this Step() was accepted.
  for (size_t chunk : order) {
    Chunk& c = e.chunks()[chunk];
    ChunkStep& s = steps_[chunk];
    // Stage 3 gathers parameters when the trainer acquires them (ParamGather), not here.
    if (c.params_sharded) continue;
    e.metrics().collective_of(CollectiveKind::kAllGather).Increment(double(c.working_bytes(wsize)));
    comm.AllGather(
        c.param_copy.data() + c.shard.begin * wsize, c.param_copy.data(), c.shard.numel(),
        e.working_dtype(), [&s] { return s.shard_updated.Wait(); },
        [&e, &s](Status status) {
          boost::asio::post(e.loop().executor(), [&s, status = std::move(status)] {
            s.gather_status = status;
            s.params_gathered->Release();
          });
        });
  }
  // Last, the outcome: it always runs (the failure is its value, not a failed input), so
  // every rank learns at once that another's step failed.
  comm.AllReduceScalars(
      failed_ranks_, ReduceOp::kSum,
      [this] {
        std::fill(failed_ranks_.begin(), failed_ranks_.end(), 0.0);
        failed_ranks_[size_t(engine_.rank())] = step_outcome_.Wait().ok() ? 0.0 : 1.0;
        return Status();
      },
      [this, &e](Status status) {
        boost::asio::post(e.loop().executor(), [this, status = std::move(status)] {
          std::vector<int> failed;
          for (size_t r = 0; r < failed_ranks_.size(); ++r) {
            if (failed_ranks_[r] > 0) failed.push_back(int(r));
          }
          AgreeOnStep(status, std::move(failed));
        });
      });
}

void StepPipeline::AgreeOnStep(Status collective, std::vector<int> failed_ranks) {
  // A collective that failed before (a peer that left or timed out) fails this one without
  // waiting for its input: the step may not be finished yet. Whichever of the two comes second
  // delivers.
  step_.agreement.emplace(std::move(collective), std::move(failed_ranks));
  if (step_.outcome) DeliverAgreedStep();
}

void StepPipeline::DeliverAgreedStep() {
  auto [collective, failed_ranks] = std::move(*step_.agreement);
  step_.agreement.reset();
  Result<StepReport> result = std::move(*step_.outcome);
  step_.outcome.reset();
  // Ranks that all committed alike may go on (every rank's fp16 step skipped at the minimum
  // scale, say); a step that failed on some ranks only, or whose agreement failed, leaves them
  // apart, and none may (CheckShardedStepLocked).
  const int ranks = engine_.ranks();
  const bool completed = step_.outcome_completed && collective.ok() &&
                         (failed_ranks.empty() || int(failed_ranks.size()) == ranks);
  if (result.ok() && !collective.ok()) {
    result = collective.WithContext("agreeing on the step's outcome across ranks");
  } else if (result.ok() && !failed_ranks.empty()) {
    std::string which;
    for (int r : failed_ranks) which += (which.empty() ? "" : ", ") + std::to_string(r);
    result = Unavailable("the step failed on rank " + which + " of " + std::to_string(ranks) +
                         " (another rank: its error is in that rank's output); restart the "
                         "ranks");
  }
  DeliverStep(std::move(result), completed);
}

namespace {

/// Partition r of `gradients` (fp32, ranks × shard_numel) quantized to `bits` into block r of
/// `sent`.
Status QuantizePartitions(cpu_adam::CpuOptimizer& optimizer, const float* gradients,
                          size_t shard_numel, int ranks, int bits, std::byte* sent) {
  const size_t bytes = cpu_adam::QuantizedBytes(shard_numel, bits);
  for (int r = 0; r < ranks; ++r) {
    STRATA_RETURN_IF_ERROR(optimizer.Quantize(gradients + size_t(r) * shard_numel, DType::kFp32,
                                              shard_numel, bits, sent + size_t(r) * bytes));
  }
  return Status();
}

/// shard[i] (+)= the sum over ranks, in rank order and fp32, of element i of each rank's block of
/// `received` dequantized (into `scratch`, ranks × shard_numel floats); `first` overwrites.
Status SumReceivedPartitions(cpu_adam::CpuOptimizer& optimizer, const std::byte* received,
                             size_t shard_numel, int ranks, int bits, float* scratch, float* shard,
                             bool first) {
  const size_t bytes = cpu_adam::QuantizedBytes(shard_numel, bits);
  for (int r = 0; r < ranks; ++r) {
    STRATA_RETURN_IF_ERROR(optimizer.Dequantize(received + size_t(r) * bytes, bits, shard_numel,
                                                scratch + size_t(r) * shard_numel, DType::kFp32));
  }
  optimizer.ParallelFor(shard_numel, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      float sum = scratch[i];
      for (int r = 1; r < ranks; ++r) sum += scratch[size_t(r) * shard_numel + i];
      shard[i] = first ? sum : shard[i] + sum;
    }
  });
  return Status();
}

}  // namespace

Awaitable<uint64_t> StepPipeline::FillReduceSlot(size_t chunk) {
  StepEngine& e = engine_;
  Chunk& c = e.chunks()[chunk];
  ChunkStep& s = steps_[chunk];
  co_await s.reduce_queued->Acquire();
  const uint64_t number = s.reduce_numbers.front();
  s.reduce_numbers.pop_front();
  // Never queued: Cancel ended the step, and no collective comes (see ReduceGrads).
  if (number == ChunkStep::kNeverQueued) {
    s.landing_taken.Open(Status());
    co_return number;
  }
  co_await e.reduce_ring().WaitTurn(number);
  auto fill = [&]() -> Status {
    float* widened = e.reduce_ring().Input(number);
    const float* gradients = widened;
    if (e.sums_micro_steps()) {
      gradients = reinterpret_cast<const float*>(c.grads_sum.data());
    } else {
      SumGrads(widened, s.landed_grads, e.working_dtype(), c.numel, /*first=*/true);
    }
    if (!e.quantizes_gradients()) return Status();
    return QuantizePartitions(e.cpu(), gradients, c.shard.numel(), e.ranks(),
                              e.gradient_quant_bits(), e.reduce_ring().Sent(number));
  };
  Status filled = co_await AwaitJob(e.jobs(), fill, &e.jobs_in_flight());
  // The collective runs whatever happened here (see ReduceGrads); this rank's step fails.
  if (!filled.ok() && s.land_status.ok()) s.land_status = filled;
  e.reduce_ring().MarkFilled(number);
  s.landing_taken.Open(Status());  // The next micro-step may land.
  e.reduce_ring().Release(number);  // Written: the slot is the next number's once read.
  co_return number;
}

Awaitable<void> StepPipeline::ReduceGrads(size_t chunk, int micro_step) {
  StepEngine& e = engine_;
  Chunk& c = e.chunks()[chunk];
  ChunkStep& s = steps_[chunk];
  const bool each_micro_step = e.reduces_each_micro_step();
  // The reduce-scatter runs whatever this rank's landing did: a failed landing fails this
  // rank's step (land_status), and every rank learns of it from the step's outcome all-reduce.
  // A failed input would fail the collective on this rank only, and MPI peers would wait for it
  // until their timeout.
  uint64_t number = ChunkStep::kNeverQueued;
  if (e.reduces_from_ring()) {
    number = co_await FillReduceSlot(chunk);
    if (number == ChunkStep::kNeverQueued) {
      // Cancel: no collective, so no result to take. Another micro-step's may still be on its
      // way, for that micro-step's journey.
      s.land_status = Cancelled("the engine was destroyed before Step()");
      co_return;
    }
  } else {
    s.grads_summed.Open(Status());  // grads_sum holds them.
  }
  // Reducing every micro-step, the micro-steps' shards are added in their order, one at a time.
  if (each_micro_step) co_await s.shard_sum_turn->Acquire();
  co_await s.grads_reduced->Acquire();
  const Status reduced = std::move(s.reduce_results.front());
  s.reduce_results.pop_front();
  if (JourneyReadsReduceSlot()) {
    if (reduced.ok()) {
      // This rank's shard: the sum of every rank's partition it received, or what the
      // reduce-scatter wrote, added to the earlier micro-steps'.
      const bool first = !each_micro_step || micro_step == 1;
      auto sum = [&]() -> Status {
        float* shard = reinterpret_cast<float*>(c.grads_shard.data());
        if (!e.quantizes_gradients()) {
          SumGrads(shard, e.reduce_ring().Output(number), DType::kFp32, c.shard.numel(), first);
          return Status();
        }
        return SumReceivedPartitions(e.cpu(), e.reduce_ring().Received(number),
                                     c.shard.numel(), e.ranks(), e.gradient_quant_bits(),
                                     e.reduce_ring().Input(number), shard, first);
      };
      Status summed = co_await AwaitJob(e.jobs(), sum, &e.jobs_in_flight());
      if (!summed.ok() && s.land_status.ok()) s.land_status = summed;
    }
    e.reduce_ring().Release(number);  // Read: the slot is the next number's.
  }
  if (each_micro_step) s.shard_sum_turn->Release();
  if (!reduced.ok()) s.land_status = reduced.WithContext("reducing the gradients across ranks");
  // The shard is complete at the last micro-step, and measured then.
  if (!s.land_status.ok() || micro_step != gas_) co_return;
  auto measure = [&] {
    return e.cpu().ComputeGradientStats(c.grads_shard.data(), DType::kFp32, c.shard.numel());
  };
  Result<cpu_adam::GradientStats> stats = co_await AwaitJob(e.jobs(), measure, &e.jobs_in_flight());
  s.land_status = stats.status();
  if (stats.ok()) s.stats = *stats;
}

Awaitable<void> StepPipeline::GatherParams(size_t chunk) {
  Chunk& c = engine_.chunks()[chunk];
  ChunkStep& s = steps_[chunk];
  if (step_.progress == StepProgress::kCancelled) co_return;  // No Step(): no all-gather to wait for (Cancel).
  const bool updated = s.phase_now() == ChunkPhase::kUpdated;
  // The all-gather runs whatever this rank's update did (as the reduce-scatter, see
  // ReduceGrads). A skipped step gathers and uploads nothing; a chunk not updated otherwise
  // fails this rank's step, and so, through the outcome all-reduce, every rank's.
  if (!updated && !step_.skip && step_.error.ok()) {
    KeepFirstError(Internal("chunk " + std::to_string(chunk) + " was not updated on rank " +
                            std::to_string(engine_.rank())));
  }
  if (c.params_sharded) {
    // Stage 3 gathers nothing here: the shard's new parameters wait in param_copy (or the
    // shadow extent, on NVMe) for the commit, and the next Acquire gathers them.
    s.gathered = true;
    co_return;
  }
  s.shard_updated.Open(Status());
  co_await s.params_gathered->Acquire();
  s.gathered = true;
  if (!s.gather_status.ok()) {
    KeepFirstError(s.gather_status.WithContext("gathering the parameters of chunk " +
                                               std::to_string(chunk) + " across ranks"));
  } else if (updated) {
    if (Status uploaded = UploadEarly(chunk); !uploaded.ok()) {
      KeepFirstError(
          uploaded.WithContext("uploading the parameters of chunk " + std::to_string(chunk)));
    }
  }
}

}  // namespace strata::offload
