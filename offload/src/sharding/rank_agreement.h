// Agreement across ranks on the outcome of an operation every rank runs between steps (a
// sharded Save or Load): a rank that failed must not leave the others going on as if it had
// not, and none may wait for it in a later collective.
#pragma once

#include <string>

#include "strata/core/status.h"
#include "strata/offload/communicator.h"

namespace strata::offload::internal {

/// Blocks until every rank has said how `what` went for it (`mine`), then returns the same
/// verdict on every rank: OK when all succeeded; this rank's own error where it failed;
/// elsewhere Unavailable naming the ranks that failed ("<what> failed on rank 1 of 2; its own
/// error says why"). A collective that fails (a peer that left, a timeout) returns its error,
/// with `what` as context. Every rank must call it at the same point, from the trainer thread.
Status AgreeAcrossRanks(Communicator& comm, const Status& mine, const std::string& what);

}  // namespace strata::offload::internal
