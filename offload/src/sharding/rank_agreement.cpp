#include "sharding/rank_agreement.h"

#include <vector>

namespace strata::offload::internal {

Status AgreeAcrossRanks(Communicator& comm, const Status& mine, const std::string& what) {
  // One slot per rank, 1 where it failed: the sum says who.
  std::vector<double> failed(size_t(comm.size()), 0.0);
  failed[size_t(comm.rank())] = mine.ok() ? 0.0 : 1.0;
  if (Status agreed = comm.AllReduceSum(failed); !agreed.ok()) {
    return agreed.WithContext("agreeing across ranks on " + what);
  }
  if (!mine.ok()) return mine;
  std::string which;
  for (size_t r = 0; r < failed.size(); ++r) {
    if (failed[r] != 0.0) which += (which.empty() ? "" : ", ") + std::to_string(r);
  }
  if (which.empty()) return Status();
  return Unavailable(what + " failed on rank " + which + " of " + std::to_string(comm.size()) +
                     "; its own error says why");
}

}  // namespace strata::offload::internal
