// Compiled instead of cuda_device.cpp when this build has no CUDA toolkit.
#include "strata/core/cuda_device.h"

namespace strata {
namespace {
Status NotBuilt() {
  return Unavailable(
      "this build of Strata has no CUDA support (no CUDA compiler was found when it was "
      "configured; install the CUDA toolkit and reconfigure with -DSTRATA_WITH_CUDA=ON)");
}
}  // namespace

bool BuiltWithCuda() { return false; }
Result<std::string> CudaVersionString() { return NotBuilt(); }
Result<std::vector<CudaDeviceInfo>> ListCudaDevices() { return NotBuilt(); }
Result<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions&) { return NotBuilt(); }

}  // namespace strata
