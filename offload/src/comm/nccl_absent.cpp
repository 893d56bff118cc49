// Built without NCCL (no CUDA toolkit with NCCL was found): CreateNcclCommunicator says so.
#include "strata/offload/nccl_communicator.h"

namespace strata::offload {

bool NcclAvailable() { return false; }

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclCommunicatorOptions&) {
  return Unavailable(
      "this build has no NCCL: install the CUDA toolkit with NCCL (libnccl-dev) and configure "
      "again (STRATA_WITH_CUDA); on host memory, ranks use MPI");
}

}  // namespace strata::offload
