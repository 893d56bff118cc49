#include "system_info.h"

#include <liburing.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

namespace strata::tools {

CpuInfo ProbeCpu() {
  CpuInfo cpu;
  cpu.logical_cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  std::ifstream in("/proc/cpuinfo");
  std::set<std::pair<std::string, std::string>> cores;  // (physical id, core id)
  std::string line, physical_id;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
    std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (key == "model name" && cpu.model.empty()) cpu.model = value;
    if (key == "physical id") physical_id = value;
    if (key == "core id") cores.emplace(physical_id, value);
  }
  cpu.physical_cores = cores.empty() ? cpu.logical_cpus : static_cast<int>(cores.size());
  if (cpu.model.empty()) cpu.model = "unknown";
  cpu.features = DetectCpuFeatures();
  return cpu;
}

MemoryInfo ProbeMemory() {
  MemoryInfo memory;
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemTotal:") memory.total_bytes = kib * 1024;
    if (key == "MemAvailable:") memory.available_bytes = kib * 1024;
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) == 0) {
    memory.memlock_soft_bytes = limit.rlim_cur == RLIM_INFINITY ? UINT64_MAX : limit.rlim_cur;
    memory.memlock_hard_bytes = limit.rlim_max == RLIM_INFINITY ? UINT64_MAX : limit.rlim_max;
  }
  return memory;
}

IoUringInfo ProbeIoUring() {
  IoUringInfo info;
  info.liburing_version = STRATA_LIBURING_VERSION;
  io_uring ring{};
  const int result = io_uring_queue_init(4, &ring, 0);
  if (result < 0) {
    const int err = -result;
    info.reason = std::string("io_uring_setup failed: ") + std::strerror(err);
    if (err == ENOSYS) info.reason += " (the kernel has no io_uring)";
    if (err == EPERM) {
      info.reason += " (disabled by the kernel.io_uring_disabled sysctl or a seccomp filter)";
    }
    if (err == ENOMEM) info.reason += " (RLIMIT_MEMLOCK may be too low; see `ulimit -l`)";
    return info;
  }
  io_uring_queue_exit(&ring);
  info.available = true;
  io_uring_params params{};
  params.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
  if (io_uring_queue_init_params(4, &ring, &params) == 0) {
    info.defer_taskrun = true;
    io_uring_queue_exit(&ring);
  }
  return info;
}

}  // namespace strata::tools
