// Waiting on the event loop without blocking it: a counting semaphore, a staging pool built on
// one, and a latch. Every call must come from the loop thread (where the engine's coroutines
// run); none of them is thread-safe.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>

#include "strata/core/event_loop.h"
#include "strata/core/staging_pool.h"

namespace strata::offload {

/// A counting semaphore for coroutines on one event loop.
class LoopSemaphore {
 public:
  explicit LoopSemaphore(size_t count) : count_(count) {}

  /// Completes when a unit is taken.
  Awaitable<void> Acquire();
  /// Returns a unit, resuming the longest waiter if any.
  void Release();

 private:
  size_t count_;
  std::deque<std::function<void()>> waiters_;
};

/// A StagingPool for coroutines on one event loop: Acquire waits, without blocking the loop,
/// until a buffer is free.
class LoopStagingPool {
 public:
  explicit LoopStagingPool(std::unique_ptr<StagingPool> pool)
      : pool_(std::move(pool)), free_(pool_->buffer_count()) {}

  Awaitable<StagingBuffer> Acquire();
  /// Returns `buffer` (if it holds one) and wakes the longest waiter.
  void Release(StagingBuffer& buffer);
  const StagingPool& pool() const { return *pool_; }

 private:
  std::unique_ptr<StagingPool> pool_;
  LoopSemaphore free_;  // Counts the pool's free buffers.
};

/// Closed until Open(); then every waiter, present and future, goes on. Reset() closes it again.
class LoopLatch {
 public:
  Awaitable<void> Wait();
  void Open();
  void Reset() { open_ = false; }
  bool is_open() const { return open_; }

 private:
  bool open_ = false;
  std::deque<std::function<void()>> waiters_;
};

}  // namespace strata::offload
