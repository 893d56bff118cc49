// The NCCL communicator: collectives on a GPU through NCCL, for ranks that each drive one GPU
// (mpirun, srun or torchrun), on one machine or several.
//
// Each communicator has a CUDA stream and a thread of its own: collectives run one at a time in
// the order they were enqueued (Communicator's contract), each after its `ready`, and its
// completion is polled until done or until the timeout, which aborts the NCCL communicator
// (ncclCommAbort) and fails this and every later collective with an error naming the peers a
// dead or stopped rank could be — where a plain NCCL call would hang every rank.
//
// Buffers may be in GPU memory, where NCCL reads and writes them in place, or in host memory,
// which goes through device scratch memory of the communicator's (a copy each way on its
// stream): the engine's sharded path hands host buffers today (gradients summed in host fp32,
// parameter shards in host memory), and a device-side path can hand device ones unchanged.
//
// The ranks agree on NCCL's unique id first: rank 0 makes it, and the others receive it over
// a communicator they already share (MPI, under mpirun or srun) or, without one, through a
// file every rank sees (torchrun, srun without MPI).
#pragma once

#include <filesystem>
#include <memory>
#include <optional>

#include "strata/core/status.h"
#include "strata/offload/communicator.h"

namespace strata::offload {

struct NcclCommunicatorOptions {
  int rank = 0;  ///< This rank, 0 .. size - 1 (DetectRanks).
  int size = 1;  ///< Ranks in the job.
  /// The GPU this rank drives (cudaSetDevice index): usually its local rank.
  int device_index = 0;
  /// Shares rank 0's NCCL id when set (its ranks must be these ranks, e.g. an MPI
  /// communicator); only used while creating.
  Communicator* bootstrap = nullptr;
  /// Without a bootstrap: the file rank 0 writes the id to and the others read, on a file
  /// system every rank sees and new to this job (a file an earlier job left would be read as
  /// this one's).
  std::filesystem::path id_file;
  /// How long creating the communicator and each collective may wait for the other ranks
  /// before failing, in seconds (> 0). placement.collective_timeout_seconds.
  double timeout_seconds = 600.0;
  /// This rank's place on its node (the launcher's RankInfo local rank and size), for
  /// Communicator::node(). Unset: every rank counts as on this node.
  std::optional<NodePlace> node;
};

/// Whether this build has NCCL (a CUDA toolkit with NCCL was found).
bool NcclAvailable();

/// Creates this rank's NCCL communicator; every rank calls it. Errors: Unavailable in a build
/// without NCCL, when the GPU cannot be used, or when the other ranks do not join within the
/// timeout; InvalidArgument for a rank, size, node place or timeout out of range, or neither a
/// bootstrap nor an id file with several ranks; Internal for an NCCL failure (with NCCL's message).
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    const NcclCommunicatorOptions& options);

}  // namespace strata::offload
