// Local communicators: a group of ranks that are threads of one process, joined by shared
// memory. What engine tests shard with (several engines, one per thread, each with its own
// HostDevice), and a reference the MPI and NCCL communicators are compared against.
//
// Each communicator runs its collectives on a thread of its own, in the order enqueued (the
// Communicator contract); a collective runs once every rank has reached it, reading the
// others' inputs in place. Beyond MPI it checks what MPI cannot: ranks that enqueued different
// collectives (another kind, count, dtype or operation) at the same position fail with
// InvalidArgument naming both, where MPI would hang or mix buffers. A rank whose input failed
// (its ready function) fails the collective on every rank at once, and a communicator
// destroyed with peers still waiting fails their collectives at once ("rank r left"): what a
// dead process becomes under MPI after its timeout.
#pragma once

#include <memory>
#include <vector>

#include "strata/core/status.h"
#include "strata/offload/communicator.h"

namespace strata::offload {

struct LocalCommunicatorOptions {
  int size = 2;  ///< Ranks in the group (>= 1).
  /// How long one collective may wait for the other ranks to reach it, in seconds (> 0).
  double timeout_seconds = 600.0;
  /// Ranks per node, in rank order (the last node may hold fewer), for Communicator::node():
  /// ranks 0..n-1 on the first node, n..2n-1 on the second. 0: all on one node.
  int ranks_per_node = 0;
};

/// One communicator per rank, rank r at index r. Each may be used from its own thread and
/// destroyed in any order. InvalidArgument for a size < 1, a timeout <= 0 or ranks_per_node < 0.
Result<std::vector<std::unique_ptr<Communicator>>> CreateLocalCommunicators(
    const LocalCommunicatorOptions& options);

}  // namespace strata::offload
