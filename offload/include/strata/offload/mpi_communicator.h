// The MPI communicator: collectives over host memory through MPI (Open MPI), for ranks started
// by mpirun or srun. It is what HostDevice shards with, so every sharded path runs and is
// tested on a machine without GPUs.
//
// One thread per process makes every MPI call, for every MPI communicator, one collective at a
// time in the order they were enqueued (across communicators too: enqueue the collectives of
// different communicators in the same order on every rank, as with NCCL communicators that
// share a stream). MPI is initialized there for every thread (MPI_THREAD_MULTIPLE) on first
// use and finalized at process exit, so a trainer that never touches MPI needs nothing more and
// one that does may call it from its own threads. A trainer that initialized MPI before must
// have asked for MPI_THREAD_MULTIPLE; one that finalizes it itself may, and the communicators
// left then do nothing.
//
// Each collective is nonblocking MPI polled until done or until the timeout: a peer that died
// or stopped enqueueing collectives becomes an error naming the collective and the wait, where
// a blocking call would hang every rank. MPI cannot cancel a collective, so one that timed out
// may still write its output buffers should the peer come back: after such an error, keep
// them alive and exit (every later collective fails the same way). AllReduceScalars works on a
// copy of its own, so its span need not outlive the error.
#pragma once

#include <memory>
#include <optional>

#include "strata/core/status.h"
#include "strata/offload/communicator.h"

namespace strata::offload {

struct MpiCommunicatorOptions {
  /// How long one collective may wait for its peers before it fails, in seconds (> 0).
  /// torch.distributed's default is 10 minutes too.
  double timeout_seconds = 600.0;
  /// This rank's place on its node (the launcher's RankInfo local rank and size), for
  /// Communicator::node(): 0 <= local_rank < local_size, taken as the launcher says (not
  /// checked against MPI's size). Unset: every rank counts as on this node.
  std::optional<NodePlace> node;
};

/// Whether this build has MPI (STRATA_WITH_MPI).
bool MpiAvailable();

/// A communicator over MPI_COMM_WORLD (a duplicate of it). Collective: every rank creates its
/// communicators in the same order, and not from a collective's callback. Errors: Unavailable in a
/// build without MPI, or when MPI was finalized or initialized by the trainer below
/// MPI_THREAD_MULTIPLE, or when the other ranks do not join within the timeout;
/// InvalidArgument for a timeout <= 0 or a node place that is not one among the ranks; Internal
/// when MPI fails to start.
Result<std::unique_ptr<Communicator>> CreateMpiCommunicator(const MpiCommunicatorOptions& options);

}  // namespace strata::offload
