// The MPI communicator: collectives over host memory through MPI (Open MPI), for ranks started
// by mpirun or srun. It is what HostDevice shards with, so every sharded path runs and is
// tested on a machine without GPUs.
//
// One thread per process makes every MPI call, in the order collectives were enqueued: MPI is
// initialized there (MPI_THREAD_FUNNELED) on first use and finalized at process exit, so a
// trainer that never touches MPI itself needs nothing more. A trainer that initialized MPI
// before must have asked for MPI_THREAD_MULTIPLE, since its calls and this thread's may overlap.
//
// Each collective is nonblocking MPI polled until done or until the timeout: a peer that died
// or stopped enqueueing collectives becomes an error naming the collective and the wait, where
// a blocking call would hang every rank. MPI cannot cancel a collective, so one that timed out
// may still write its output buffers should the peer come back: after such an error, keep
// them alive and exit (every later collective fails the same way).
#pragma once

#include <memory>

#include "strata/core/status.h"
#include "strata/offload/communicator.h"

namespace strata::offload {

struct MpiCommunicatorOptions {
  /// How long one collective may wait for its peers before it fails, in seconds (> 0).
  /// torch.distributed's default is 10 minutes too.
  double timeout_seconds = 600.0;
};

/// Whether this build has MPI (STRATA_WITH_MPI).
bool MpiAvailable();

/// A communicator over MPI_COMM_WORLD (a duplicate of it). Errors: Unavailable in a build
/// without MPI, or when MPI was finalized or initialized by the trainer below
/// MPI_THREAD_MULTIPLE; InvalidArgument for a timeout <= 0; Internal when MPI fails to start.
Result<std::unique_ptr<Communicator>> CreateMpiCommunicator(const MpiCommunicatorOptions& options);

}  // namespace strata::offload
