// How NCCL's ranks agree on the unique id that names their communicator: rank 0 makes it and
// every other rank receives it, over a communicator the ranks already share (MPI under mpirun,
// or srun with MPI) or, without one (torchrun, srun without MPI), through a file rank 0 writes
// where every rank can read it. Bytes in, bytes out: nothing of NCCL here, so it is tested on
// machines without a GPU.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <vector>

#include "strata/core/status.h"
#include "strata/offload/communicator.h"

namespace strata::offload::internal {

struct IdExchange {
  int rank = 0;
  /// Ranks that can already talk (their rank() is the NCCL rank): the id goes over it.
  Communicator* bootstrap = nullptr;
  /// Without a bootstrap: the file rank 0 writes (atomically) and the others wait for. It must
  /// be on a file system every rank sees and new to this job: a file an earlier job left would
  /// be read as this job's id.
  std::filesystem::path file;
  /// How long a rank waits for rank 0's id, in seconds.
  double timeout_seconds = 600.0;
};

/// Rank 0's `id` on every rank. Every rank passes an `id` of the same size (its bytes matter on
/// rank 0 only). Errors: Unavailable when rank 0's id does not come within the timeout (naming
/// the file), InvalidArgument without a bootstrap or a file, IoError when the file cannot be
/// written or read.
Result<std::vector<std::byte>> ShareFromRankZero(const IdExchange& how,
                                                 std::span<const std::byte> id);

}  // namespace strata::offload::internal
