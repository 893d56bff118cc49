// What a collective that timed out says in its error, in the same words on every transport:
// how long it waited ("%g s") and whom for. A nonblocking collective (MPI's or NCCL's) does not
// say which peer is missing, so the error names every other rank, or with two ranks the other
// one.
#pragma once

#include <string>

#include "strata/core/status.h"

namespace strata::offload::internal {

/// "rank 1, the other rank," or "one of ranks 0, 2, 3", for `rank` of `size`.
std::string PeersOf(int rank, int size);

/// "0.5 s", "600 s": a timeout as every collective error writes it.
std::string FormatSeconds(double seconds);

/// Unavailable: "<what> did not complete within <seconds>: <why>".
Status DidNotComplete(const std::string& what, double seconds, const std::string& why);

/// Why a collective waited in vain: "<peers> died, hangs or stopped enqueueing the same
/// collectives (<option>)", `option` naming the setting that holds the timeout.
std::string PeersStopped(const std::string& peers, const std::string& option);

}  // namespace strata::offload::internal
