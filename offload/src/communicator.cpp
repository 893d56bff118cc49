#include "strata/offload/communicator.h"

namespace strata::offload {
namespace {

class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Status AllReduceSum(std::span<double> /*values*/) override { return Status(); }
};

}  // namespace

std::unique_ptr<Communicator> CreateSingleRankCommunicator() {
  return std::make_unique<SingleRankCommunicator>();
}

}  // namespace strata::offload
