// What a collective that timed out waited for, in its error: a nonblocking collective (MPI's or
// NCCL's) does not say which peer is missing, so the error names every other rank, or with
// two ranks the other one.
#pragma once

#include <string>

namespace strata::offload::internal {

/// "rank 1, the other rank," or "one of ranks 0, 2, 3", for `rank` of `size`.
std::string PeersOf(int rank, int size);

}  // namespace strata::offload::internal
