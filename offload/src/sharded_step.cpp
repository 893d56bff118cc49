// A step across several ranks (ZeRO stages 1 and 2): the collectives of each chunk and of the
// step, enqueued on the trainer thread in one order on every rank, the journey's two waits on
// them, and the agreement on the step's outcome.
// See "Sharding" in step_pipeline.h.
#include <algorithm>
#include <string>
#include <vector>

#include "engine_impl.h"

namespace strata::offload {

bool StepPipeline::sharded() const { return engine_.sharded(); }

Status StepPipeline::CheckShardedStepLocked() const {
  if (!sharded()) return Status();
  if (attempt_failed_) {
    return FailedPrecondition(
        "a failed step cannot be retried with the optimizer states sharded across " +
        std::to_string(engine_.ranks()) +
        " ranks: the ranks' states may differ; restart the ranks");
  }
  const std::vector<Chunk>& chunks = engine_.chunks_;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (!chunks[i].frozen() && chunks[i].micro_steps == 0) {
      return FailedPrecondition(
          "chunk " + std::to_string(i) + " received no gradients this step; with several ranks " +
          "every trained chunk needs them in every step (each rank reduces every chunk)");
    }
  }
  return Status();
}

void StepPipeline::DeclareReduceLocked(size_t chunk) {
  Chunk& c = engine_.chunks_[chunk];
  // Nothing of this step has touched the chunk's signals yet: its journey, spawned next,
  // opens them, maybe before its reduce-scatter is enqueued.
  c.grads_summed.Reset();
  c.shard_updated.Reset();
  // Reduce-scatters go in one order on every rank, backward's (the last chunk first), whatever
  // order this rank's trainer declares gradients in: a chunk whose turn has not come waits for
  // the chunks before it. Ranks that matched collectives by arrival would sum one rank's chunk
  // with another's whenever their sizes agree.
  const std::vector<Chunk>& chunks = engine_.chunks_;
  while (reduce_order_.size() < reduce_sequence_.size() &&
         chunks[reduce_sequence_[reduce_order_.size()]].micro_steps == gas_) {
    EnqueueReduceLocked(reduce_sequence_[reduce_order_.size()]);
  }
}

void StepPipeline::EnqueueReduceLocked(size_t chunk) {
  Engine::Impl& e = engine_;
  Chunk& c = e.chunks_[chunk];
  reduce_order_.push_back(chunk);
  const bool ring = e.reduces_from_ring();
  const bool quantized = e.quantizes_gradients();
  const uint64_t number = ring ? e.reduce_ring_.Next() : 0;
  if (ring) {
    // The journey fills the slot when its turn comes (FillReduceSlot).
    boost::asio::post(e.loop_.executor(), [&c, number] {
      c.reduce_number = number;
      c.reduce_queued->Release();
    });
  }
  auto ready = [&c] { return c.grads_summed.Wait(); };
  auto done = [&e, &c, ring, quantized, number](Status status) {
    boost::asio::post(e.loop_.executor(),
                      [&e, &c, ring, quantized, number, status = std::move(status)] {
                        // Done reading the slot, whatever its outcome (quantized: the journey reads
                        // what was received, and releases it then).
                        if (ring && !quantized) e.reduce_ring_.Release(number);
                        c.reduce_status = status;
                        c.grads_reduced->Release();
                      });
  };
  Communicator& comm = *e.environment_.communicator;
  if (quantized) {
    // Each rank's partition of this rank's gradients, quantized, to that rank.
    const size_t bytes = cpu_adam::QuantizedBytes(c.shard.numel(), e.gradient_quant_bits());
    e.m_.collective_of(CollectiveKind::kReduceScatter).Increment(double(bytes * size_t(e.ranks())));
    comm.AllToAll(e.reduce_ring_.Sent(number), e.reduce_ring_.Received(number),
                  bytes / sizeof(float), DType::kFp32, std::move(ready), std::move(done));
    return;
  }
  e.m_.collective_of(CollectiveKind::kReduceScatter)
      .Increment(double(c.numel * DTypeSize(DType::kFp32)));
  const void* input =
      ring ? static_cast<const void*>(e.reduce_ring_.Input(number)) : c.grads_sum.data();
  comm.ReduceScatter(input, c.grads_shard.data(), c.shard.numel(), DType::kFp32, ReduceOp::kSum,
                     std::move(ready), std::move(done));
}

void StepPipeline::EnqueueStepCollectives(const std::vector<size_t>& order) {
  Engine::Impl& e = engine_;
  Communicator& comm = *e.environment_.communicator;
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
        boost::asio::post(e.loop_.executor(), [this, status = std::move(status)] {
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
    Chunk& c = e.chunks_[chunk];
    // Stage 3 gathers parameters when the trainer acquires them (ParamGather), not here.
    if (c.params_sharded) continue;
    e.m_.collective_of(CollectiveKind::kAllGather).Increment(double(c.working_bytes(wsize)));
    comm.AllGather(
        c.param_copy.data() + c.shard.begin * wsize, c.param_copy.data(), c.shard.numel(),
        e.working_dtype(), [&c] { return c.shard_updated.Wait(); },
        [&e, &c](Status status) {
          boost::asio::post(e.loop_.executor(), [&c, status = std::move(status)] {
            c.gather_status = status;
            c.params_gathered->Release();
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
        boost::asio::post(e.loop_.executor(), [this, status = std::move(status)] {
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

/// shard[i] = the sum over ranks, in rank order and fp32, of element i of each rank's block of
/// `received` dequantized (into `scratch`, ranks × shard_numel floats).
Status SumReceivedPartitions(cpu_adam::CpuOptimizer& optimizer, const std::byte* received,
                             size_t shard_numel, int ranks, int bits, float* scratch,
                             float* shard) {
  const size_t bytes = cpu_adam::QuantizedBytes(shard_numel, bits);
  for (int r = 0; r < ranks; ++r) {
    STRATA_RETURN_IF_ERROR(optimizer.Dequantize(received + size_t(r) * bytes, bits, shard_numel,
                                                scratch + size_t(r) * shard_numel, DType::kFp32));
  }
  optimizer.ParallelFor(shard_numel, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      float sum = scratch[i];
      for (int r = 1; r < ranks; ++r) sum += scratch[size_t(r) * shard_numel + i];
      shard[i] = sum;
    }
  });
  return Status();
}

}  // namespace

Awaitable<void> StepPipeline::FillReduceSlot(Chunk& c) {
  Engine::Impl& e = engine_;
  co_await c.reduce_queued->Acquire();
  // Never queued: Cancel ended the step, and released grads_reduced with its status.
  if (c.reduce_number == Chunk::kNeverQueued) co_return;
  const uint64_t number = c.reduce_number;
  co_await e.reduce_ring_.WaitTurn(number);
  auto fill = [&]() -> Status {
    float* widened = e.reduce_ring_.Input(number);
    const float* gradients = widened;
    if (gas_ == 1) {
      WidenGrads(widened, c.grads_landing.data(), c.numel);
    } else {
      gradients = reinterpret_cast<const float*>(c.grads_sum.data());
    }
    if (!e.quantizes_gradients()) return Status();
    return QuantizePartitions(*e.optimizer_, gradients, c.shard.numel(), e.ranks(),
                              e.gradient_quant_bits(), e.reduce_ring_.Sent(number));
  };
  Status filled = co_await AwaitJob(e.jobs_, fill, &e.jobs_in_flight_);
  // The collective runs whatever happened here (see ReduceGrads); this rank's step fails.
  if (!filled.ok() && c.land_status.ok()) c.land_status = filled;
  c.grads_summed.Open(Status());
  e.reduce_ring_.Release(number);  // Written: the slot is the next number's once read.
}

Awaitable<void> StepPipeline::ReduceGrads(size_t chunk) {
  Engine::Impl& e = engine_;
  Chunk& c = e.chunks_[chunk];
  // The reduce-scatter runs whatever this rank's landing did: a failed landing fails this
  // rank's step (land_status), and every rank learns of it from the step's outcome all-reduce.
  // A failed input would fail the collective on this rank only, and MPI peers would wait for it
  // until their timeout.
  if (e.reduces_from_ring()) {
    co_await FillReduceSlot(c);
  } else {
    c.grads_summed.Open(Status());  // grads_sum holds them.
  }
  co_await c.grads_reduced->Acquire();
  if (e.quantizes_gradients() && c.reduce_number != Chunk::kNeverQueued) {
    // This rank's shard: the sum of every rank's partition it received.
    const uint64_t number = c.reduce_number;
    if (c.reduce_status.ok()) {
      auto sum = [&] {
        return SumReceivedPartitions(*e.optimizer_, e.reduce_ring_.Received(number),
                                     c.shard.numel(), e.ranks(), e.gradient_quant_bits(),
                                     e.reduce_ring_.Input(number),
                                     reinterpret_cast<float*>(c.grads_shard.data()));
      };
      Status summed = co_await AwaitJob(e.jobs_, sum, &e.jobs_in_flight_);
      if (!summed.ok() && c.land_status.ok()) c.land_status = summed;
    }
    e.reduce_ring_.Release(number);  // Read: the slot is the next number's.
  }
  if (!c.reduce_status.ok()) {
    c.land_status = c.reduce_status.WithContext("reducing the gradients across ranks");
    co_return;
  }
  if (!c.land_status.ok()) co_return;
  auto measure = [&] {
    return e.optimizer_->ComputeGradientStats(c.grads_shard.data(), DType::kFp32, c.shard.numel());
  };
  Result<cpu_adam::GradientStats> stats = co_await AwaitJob(e.jobs_, measure, &e.jobs_in_flight_);
  c.land_status = stats.status();
  if (stats.ok()) c.stats = *stats;
}

Awaitable<void> StepPipeline::GatherParams(size_t chunk) {
  Chunk& c = engine_.chunks_[chunk];
  if (step_.cancelled) co_return;  // No Step(): no all-gather to wait for (Cancel).
  const bool updated = c.phase_now() == ChunkPhase::kUpdated;
  // The all-gather runs whatever this rank's update did (as the reduce-scatter, see
  // ReduceGrads). A skipped step gathers and uploads nothing; a chunk not updated otherwise
  // fails this rank's step, and so, through the outcome all-reduce, every rank's.
  if (!updated && !step_.skip && step_.error.ok()) {
    KeepFirstError(Internal("chunk " + std::to_string(chunk) + " was not updated on rank " +
                            std::to_string(engine_.rank())));
  }
  if (c.params_sharded) {
    // Stage 3 gathers nothing here: the shard's new parameters wait in param_copy for the
    // commit, and the next Acquire gathers them.
    c.gathered = true;
    co_return;
  }
  c.shard_updated.Open(Status());
  co_await c.params_gathered->Acquire();
  c.gathered = true;
  if (!c.gather_status.ok()) {
    KeepFirstError(c.gather_status.WithContext("gathering the parameters of chunk " +
                                               std::to_string(chunk) + " across ranks"));
  } else if (updated) {
    if (Status uploaded = UploadEarly(chunk); !uploaded.ok()) {
      KeepFirstError(
          uploaded.WithContext("uploading the parameters of chunk " + std::to_string(chunk)));
    }
  }
}

}  // namespace strata::offload
