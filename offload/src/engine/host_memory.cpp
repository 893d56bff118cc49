#include "engine/host_memory.h"

#include <tbb/info.h>
#include <unistd.h>

#include <algorithm>

#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"

namespace strata::offload {
uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  return pages > 0 && page_size > 0 ? uint64_t(pages) * uint64_t(page_size) : 0;
}

uint64_t HostBudgetBytes(const EngineOptions& options, int ranks_on_node) {
  if (options.host.pinned_memory_bytes > 0) return options.host.pinned_memory_bytes;
  return PhysicalMemoryBytes() / 100 * kAutomaticHostBudgetPercent /
         uint64_t(std::max(1, ranks_on_node));
}

int OptimizerThreads(const EngineOptions& options, int ranks_on_node) {
  if (options.optimizer.cpu_threads > 0) return options.optimizer.cpu_threads;
  return std::max(1, tbb::info::default_concurrency() / std::max(1, ranks_on_node));
}

uint64_t StagingPoolBytes(size_t buffer_bytes, int count) {
  return AlignUp(buffer_bytes, kHostAlignment) * uint64_t(count);
}

int MinStateBuffers(const HostOptions& host) {
  return host.optimizer_buffer_count > 0 ? host.optimizer_buffer_count : kMinStateBuffers;
}

uint64_t StateStagingRoom(uint64_t host_free_bytes, uint64_t speculation_bytes) {
  const auto least = uint64_t(double(host_free_bytes) * kStateStagingShare);
  return std::max(least, host_free_bytes - std::min(host_free_bytes, speculation_bytes));
}

int StateBufferCount(const HostOptions& host, size_t nvme_chunks, uint64_t buffer_bytes,
                     uint64_t room_bytes) {
  if (host.optimizer_buffer_count > 0) return host.optimizer_buffer_count;
  const uint64_t wanted = uint64_t(nvme_chunks) + 1;
  const uint64_t affordable = buffer_bytes > 0 ? room_bytes / buffer_bytes : wanted;
  return int(
      std::max<uint64_t>(kMinStateBuffers, std::min({wanted, affordable, uint64_t(1) << 20})));
}

}  // namespace strata::offload
