// How much host memory the engine takes: its budget, and how many staging buffers the optimizer
// states on NVMe get out of it. Shared by the engine, the pipeline benchmark's NVMe reference
// and `strata plan`'s step model, so that the three size the read-ahead alike.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/core/options.h"

namespace strata::offload {

/// The share of physical memory, in percent, the host budget is when host.pinned_memory_bytes
/// is 0 (automatic).
inline constexpr uint64_t kAutomaticHostBudgetPercent = 80;

/// The host budget: host.pinned_memory_bytes, or kAutomaticHostBudgetPercent of physical memory
/// when it is 0.
uint64_t HostBudgetBytes(const EngineOptions& options);

/// DeepSpeed's offload_optimizer.buffer_count default: the fewest state staging buffers the
/// engine runs with, and the count the host budget must leave room for.
inline constexpr int kMinStateBuffers = 4;

/// Of the host memory still free once every other host allocation is made, the share the state
/// staging buffers may take when their count is automatic.
inline constexpr double kStateStagingShare = 0.25;

/// The staging buffers the budget must hold room for: host.optimizer_buffer_count, or
/// kMinStateBuffers when that is 0 (automatic).
int MinStateBuffers(const HostOptions& host);

/// How many state staging buffers of `buffer_bytes` the engine allocates for `nvme_chunks`
/// chunks with optimizer states on NVMe, `host_free_bytes` of its budget being free otherwise.
/// host.optimizer_buffer_count when set; automatic (0): one per such chunk and one spare, so the
/// whole step's state reads can run ahead of backward — during the previous commit and forward,
/// when the drives would otherwise be idle — within kStateStagingShare of the free host memory,
/// and never fewer than kMinStateBuffers.
int StateBufferCount(const HostOptions& host, size_t nvme_chunks, uint64_t buffer_bytes,
                     uint64_t host_free_bytes);

}  // namespace strata::offload
