// Facts about this machine for `strata info`: CPU, memory, locked-memory limit, io_uring.
#pragma once

#include <cstdint>
#include <string>

#include "strata/core/cpu_features.h"

namespace strata::tools {

struct CpuInfo {
  std::string model;
  int physical_cores = 0;
  int logical_cpus = 0;
  CpuFeatures features;
};

struct MemoryInfo {
  uint64_t total_bytes = 0;
  uint64_t available_bytes = 0;
  /// RLIMIT_MEMLOCK; UINT64_MAX means unlimited. Bounds how much host memory can be pinned
  /// and io_uring buffers registered by an unprivileged process.
  uint64_t memlock_soft_bytes = 0;
  uint64_t memlock_hard_bytes = 0;
};

struct IoUringInfo {
  bool available = false;
  std::string reason;  ///< Why not, when unavailable.
  /// Whether IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN rings can be created.
  bool defer_taskrun = false;
  std::string liburing_version;  ///< Of the liburing Strata was built against.
};

CpuInfo ProbeCpu();
MemoryInfo ProbeMemory();
IoUringInfo ProbeIoUring();

}  // namespace strata::tools
