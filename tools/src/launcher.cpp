#include "launcher.h"

#include <string>
#include <utility>

namespace strata::tools {

Status CheckLaunchable(const offload::RankInfo& launched) {
  if (launched.size > 1 && !offload::MpiAvailable()) {
    return FailedPrecondition("started by " + launched.launcher +
                              " as one of several ranks, but this build has no MPI: install "
                              "Open MPI (libopenmpi-dev) and build again");
  }
  return Status();
}

Result<std::unique_ptr<offload::Communicator>> ConnectLaunchedRanks(
    const offload::RankInfo& launched, const offload::MpiCommunicatorOptions& options) {
  STRATA_RETURN_IF_ERROR(CheckLaunchable(launched));
  offload::MpiCommunicatorOptions placed = options;
  placed.node = offload::NodePlace{launched.local_rank, launched.local_size};
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<offload::Communicator> communicator,
                          offload::CreateMpiCommunicator(placed));
  if (communicator->size() != launched.size) {
    return FailedPrecondition("MPI has " + std::to_string(communicator->size()) +
                              " ranks, the launcher's variables say " +
                              std::to_string(launched.size) +
                              " (start the ranks with mpirun or srun)");
  }
  return communicator;
}

}  // namespace strata::tools
