// Communicator: the collectives the engine needs across data-parallel ranks.
//
// Collectives are enqueued, never run in place: each call queues one behind those queued before
// it and returns at once, and the communicator runs them in that order, each once its input is
// ready, reporting through a callback — as NCCL does on a CUDA stream and torch.distributed's
// work handles do. Ranks must enqueue the same collectives in the same order, so they are
// enqueued in program order from the trainer's thread (GradsReady, Acquire, Step), never from a
// completion callback, whose order differs from rank to rank.
//
// A collective is a descriptor (collective.h: kind, dtype, op, count, buffers) and Enqueue is
// the one entry point an implementation provides; AllReduce, ReduceScatter, AllGather, AllToAll
// and AllReduceScalars build the descriptor and enqueue it.
//
// Implementations: a single rank (every collective is a copy or nothing), MPI on host memory
// (mpi_communicator.h), which is what HostDevice runs with, NCCL on a CUDA stream
// (nccl_communicator.h), for ranks that each drive a GPU, and ranks that are threads of one
// process (local_communicator.h), for tests. The three with several ranks share one ordered
// queue (the worker, sticky failure, collective names and callbacks) and differ only in how the
// bytes move. With more than one rank the engine shards optimizer states (ZeRO stages 1 and 2)
// and parameters (stage 3; see "Several ranks" in docs/architecture.md).
//
// With more than one rank, an implementation must return from every enqueueing call at once and
// run `ready` on a thread of its own: the engine enqueues a collective before it starts the work
// that readies its input (a communicator that ran ready inline would wait for itself).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/offload/collective.h"

namespace strata::offload {

/// Called once per collective with its result, on the communicator's thread (or, for the single
/// rank, before the enqueueing call returns). It must not block or enqueue collectives.
using CollectiveDone = std::function<void(Status)>;
/// Blocks until a collective's input is ready (a device event has completed, say), on the
/// communicator's thread, before the collective runs; an error fails the collective without
/// running it — on this rank only, so the others will time out. Empty: ready when enqueued.
using CollectiveReady = std::function<Status()>;

/// A rank's place among the ranks on its node, which share its memory, cores and drives: the
/// launcher's local rank and size (RankInfo), handed to a communicator when it is created. It
/// is where a hierarchy of groups would start (HSDP: reduce within a node, then across nodes);
/// today every collective spans all ranks and nothing groups by it.
struct NodePlace {
  int local_rank = 0;  ///< 0 .. local_size - 1.
  int local_size = 1;  ///< Ranks on this node, this one included (<= size()).
};

/// Thread safety: the enqueueing calls from one thread at a time, in the same order on every
/// rank. Buffers must stay valid, and unwritten by anyone else, until `done` runs. A collective
/// that fails (a peer that never joins it times out) leaves the communicator failed: every
/// later one reports the same error.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// This rank's place on its node, as told when the communicator was created; untold, every
  /// rank counts as on this node (local rank = rank, local size = size), as DetectRanks
  /// assumes where the launcher does not say.
  virtual NodePlace node() const { return {rank(), size()}; }

  /// Queues `collective` behind every one enqueued before it; `ready` and `done` as above.
  /// What the descriptor's fields mean for each kind: collective.h and the helpers below.
  virtual void Enqueue(const Collective& collective, CollectiveReady ready,
                       CollectiveDone done) = 0;

  /// Element-wise `op` of `count` elements of `data` over all ranks, in place.
  void AllReduce(void* data, size_t count, DType dtype, ReduceOp op, CollectiveReady ready,
                 CollectiveDone done) {
    Enqueue(Collective::AllReduce(data, count, dtype, op), std::move(ready), std::move(done));
  }
  /// Element-wise `op` over all ranks of `send` (size() * recv_count elements); rank r receives
  /// elements [r * recv_count, (r + 1) * recv_count) of the result in `recv`.
  void ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op,
                     CollectiveReady ready, CollectiveDone done) {
    Enqueue(Collective::ReduceScatter(send, recv, recv_count, dtype, op), std::move(ready),
            std::move(done));
  }
  /// Every rank's `send_count` elements of `send`, in rank order, into `recv` on every rank.
  /// `send` may be this rank's own slot of `recv` (recv + rank() * send_count): in place.
  void AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                 CollectiveReady ready, CollectiveDone done) {
    Enqueue(Collective::AllGather(send, recv, send_count, dtype), std::move(ready),
            std::move(done));
  }

  /// Block r of `send` (`count` elements each, size() blocks) to rank r, which receives it as
  /// block `rank()` of its `recv`: every rank's blocks for this rank, in rank order. ZeRO++'s
  /// quantized gradients travel so (each rank reduces what it receives). `send` and `recv` must
  /// not overlap. Moves bits: no arithmetic.
  void AllToAll(const void* send, void* recv, size_t count, DType dtype, CollectiveReady ready,
                CollectiveDone done) {
    Enqueue(Collective::AllToAll(send, recv, count, dtype), std::move(ready), std::move(done));
  }
  /// Element-wise `op` of a step's scalars over all ranks, in place: gradient norms, overflow
  /// counts (in double, whatever the training dtype).
  void AllReduceScalars(std::span<double> values, ReduceOp op, CollectiveReady ready,
                        CollectiveDone done) {
    Enqueue(Collective::AllReduceScalars(values.data(), values.size(), op), std::move(ready),
            std::move(done));
  }

  /// AllReduceScalars, blocking until it (and so all before it) has run: for a trainer's own
  /// scalars between steps (a mean loss, the ranks' peaks), never from a callback.
  Status AllReduceNow(std::span<double> values, ReduceOp op);
  Status AllReduceSum(std::span<double> values) { return AllReduceNow(values, ReduceOp::kSum); }
  /// Every rank's `send` words (the same count on every rank) into `recv` (size() * send.size()
  /// words, in rank order; InvalidArgument otherwise), blocking as AllReduceNow: what a rank
  /// tells the others between steps (a checkpoint's file digests). The words travel as raw bits.
  Status AllGatherNow(std::span<const uint64_t> send, std::span<uint64_t> recv);
  /// The same for fp32 values: each rank's shard of a chunk's state, between steps.
  Status AllGatherNow(std::span<const float> send, std::span<float> recv);

 private:
  /// AllGather of `send_count` elements of `dtype` per rank, blocking.
  Status AllGatherBlocking(const void* send, void* recv, size_t send_count, size_t recv_count,
                           DType dtype);
};

/// The only rank: all-reduces leave the data as it is, reduce-scatter and all-gather copy.
std::unique_ptr<Communicator> CreateSingleRankCommunicator();

}  // namespace strata::offload
