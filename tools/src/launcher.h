// What `strata train` and `strata plan` share when a launcher (mpirun, srun, torchrun, PMIx)
// started them as one of several ranks: the check that this build can talk to the other ranks,
// and the MPI communicator across them.
#pragma once

#include <memory>

#include "strata/core/status.h"
#include "strata/offload/communicator.h"
#include "strata/offload/mpi_communicator.h"
#include "strata/offload/ranks.h"

namespace strata::tools {

/// FailedPrecondition when `launched` has several ranks and this build has no MPI to reach
/// them (saying what to install).
Status CheckLaunchable(const offload::RankInfo& launched);

/// An MPI communicator across the ranks the launcher started. FailedPrecondition when MPI sees
/// another number of ranks than the launcher's variables say (ranks started by hand, or by a
/// launcher whose MPI this build does not share); the errors of CreateMpiCommunicator.
Result<std::unique_ptr<offload::Communicator>> ConnectLaunchedRanks(
    const offload::RankInfo& launched, const offload::MpiCommunicatorOptions& options);

}  // namespace strata::tools
