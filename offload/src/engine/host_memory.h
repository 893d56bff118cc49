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

/// This machine's physical memory, 0 if it cannot be read.
uint64_t PhysicalMemoryBytes();

/// The host budget: host.pinned_memory_bytes, or when it is 0, kAutomaticHostBudgetPercent of
/// physical memory shared evenly by the `ranks_on_node` (>= 1) ranks on this node.
uint64_t HostBudgetBytes(const EngineOptions& options, int ranks_on_node = 1);

/// The CPU optimizer's threads: optimizer.cpu_threads, or when it is 0, this process's share of
/// the hardware threads among `ranks_on_node` ranks (at least one).
int OptimizerThreads(const EngineOptions& options, int ranks_on_node = 1);

/// Host budget a staging pool of `count` buffers of `buffer_bytes` takes (each rounded up to
/// whole pages).
uint64_t StagingPoolBytes(size_t buffer_bytes, int count);

/// DeepSpeed's offload_optimizer.buffer_count default: the fewest state staging buffers the
/// engine runs with, and the count the host budget must leave room for.
inline constexpr int kMinStateBuffers = 4;

/// Of the host memory still free once every other host allocation is made, the least share the
/// state staging buffers may take when their count is automatic, whatever speculative updates
/// would like of it.
inline constexpr double kStateStagingShare = 0.25;

/// The host memory automatic state staging may take of the `host_free_bytes` the budget has
/// left once every buffer the engine needs is in: all of it, less `speculation_bytes` — what
/// speculative updates of gated steps would keep there (a second buffer of each host-kept
/// chunk's states, the parameters from before of each NVMe-kept chunk with device parameters;
/// 0 when steps are not gated) — and never less than kStateStagingShare of it. The state
/// staging is the last fixed allocation (the parameter staging comes before it), nothing else
/// draws on the budget once the engine is created, and a read-ahead that covers more of a step
/// is what keeps the drives busy while forward runs.
uint64_t StateStagingRoom(uint64_t host_free_bytes, uint64_t speculation_bytes);

/// The staging buffers the budget must hold room for: host.optimizer_buffer_count, or
/// kMinStateBuffers when that is 0 (automatic).
int MinStateBuffers(const HostOptions& host);

/// How many state staging buffers of `buffer_bytes` the engine allocates for `nvme_chunks`
/// chunks with optimizer states on NVMe, with `room_bytes` of host memory for them
/// (StateStagingRoom). host.optimizer_buffer_count when set; automatic (0): one per such chunk
/// and one spare, so the whole step's state reads can run ahead of backward — during the
/// previous commit and forward, when the drives would otherwise be idle — as many as the room
/// holds, and never fewer than kMinStateBuffers.
int StateBufferCount(const HostOptions& host, size_t nvme_chunks, uint64_t buffer_bytes,
                     uint64_t room_bytes);

}  // namespace strata::offload
