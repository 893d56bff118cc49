// CudaDevice: the Device interface on the CUDA runtime.
//
// Built when CMake finds a CUDA toolkit (STRATA_WITH_CUDA). Without it, or on a machine with no
// GPU, these functions return Unavailable with the reason; callers never need #ifdefs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/device.h"

namespace strata {

struct CudaDeviceOptions {
  /// Which GPU (cudaSetDevice index).
  int device_index = 0;
  /// Bytes Allocate may hand out in total; 0 = the memory free on the GPU when created.
  uint64_t memory_budget_bytes = 0;
};

/// What `strata info` prints about each GPU.
struct CudaDeviceInfo {
  int index = 0;
  DeviceProperties properties;
  uint64_t free_memory_bytes = 0;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
};

/// True when this build of Strata contains CudaDevice.
bool BuiltWithCuda();

/// CUDA runtime and driver versions as "13.0 (driver 13.0)"; Unavailable when not built or no
/// driver is loaded.
Result<std::string> CudaVersionString();

/// Every visible GPU; Unavailable with the runtime's reason when there is none.
Result<std::vector<CudaDeviceInfo>> ListCudaDevices();

/// Creates a CudaDevice on one GPU with its own three non-blocking streams.
Result<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options = {});

}  // namespace strata
