// What the tests of one engine part on its own (Residency, StatePreloader, ParamGather,
// ReduceRing) share: the event loop and counted spawner the engine hands its parts, its
// metrics, and chunks filled with values that say which chunk and element they are.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/engine_metrics.h"
#include "strata/core/aligned_buffer.h"
#include "strata/core/event_loop.h"
#include "strata/core/metrics.h"

namespace strata::offload::testing {

/// The engine's metrics, registered (every series the parts update exists).
struct RegisteredMetrics {
  RegisteredMetrics() { metrics.Register(registry); }
  MetricsRegistry registry;
  EngineMetrics metrics;
};

/// An event loop and the spawner the engine hands its parts (Engine::Impl::Spawn): coroutines
/// started on the loop, counted until they end, so a test can wait until none runs.
/// Destroying it stops the loop: what is still suspended there is destroyed without resuming,
/// so a test waits (WaitIdle) before what its coroutines use goes.
class LoopWork {
 public:
  /// Starts `work` on the loop, counted until it ends.
  void Spawn(Awaitable<void> work) {
    {
      std::lock_guard lock(mutex_);
      ++running_;
    }
    boost::asio::co_spawn(loop_.executor(), std::move(work), [this](std::exception_ptr) {
      std::lock_guard lock(mutex_);
      if (--running_ == 0) idle_.notify_all();
    });
  }
  /// What a part takes as its spawner.
  std::function<void(Awaitable<void>)> spawner() {
    return [this](Awaitable<void> work) { Spawn(std::move(work)); };
  }
  /// Blocks until nothing spawned is running.
  void WaitIdle() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return running_ == 0; });
  }
  /// Runs `call` on the loop thread (where the parts' loop-only calls must come from) and
  /// returns what it returns.
  template <typename Call>
  auto OnLoop(Call call) {
    return loop_.Run(Invoke(std::move(call)));
  }
  /// Lets the loop run what is already posted to it, and what that posts in turn: a completion
  /// that a call posts runs before this returns. (Two hops: a handler posted from the loop
  /// thread joins the queue once the handler that posted it ends.)
  void Settle() {
    for (int hop = 0; hop < 2; ++hop) OnLoop([] {});
  }
  EventLoop& loop() { return loop_; }

 private:
  template <typename Call>
  static Awaitable<std::invoke_result_t<Call&>> Invoke(Call call) {
    co_return call();
  }

  std::mutex mutex_;
  std::condition_variable idle_;
  size_t running_ = 0;
  EventLoop loop_;  // Declared last: destroyed (its thread joined) first.
};

/// The value of element `i` of chunk `chunk`: small integers, exact in every dtype, and
/// different for every chunk and element that a test uses.
inline float ElementValue(size_t chunk, size_t i) { return float(chunk * 1000 + i % 997 + 1); }

/// `numel` fp32 values ElementValue(chunk, first + i), in a buffer of at least `bytes` (0: just
/// enough), the rest zero.
inline AlignedBuffer ChunkValues(size_t chunk, size_t numel, size_t first = 0, size_t bytes = 0) {
  AlignedBuffer buffer =
      std::move(AlignedBuffer::Allocate(std::max(bytes, numel * sizeof(float)))).value();
  std::memset(buffer.data(), 0, buffer.size());
  auto* values = reinterpret_cast<float*>(buffer.data());
  for (size_t i = 0; i < numel; ++i) values[i] = ElementValue(chunk, first + i);
  return buffer;
}

/// Whether `numel` fp32 values at `data` are ElementValue(chunk, first + i); names the first
/// that is not.
inline ::testing::AssertionResult HoldsChunk(const void* data, size_t chunk, size_t numel,
                                             size_t first = 0) {
  const auto* values = static_cast<const float*>(data);
  for (size_t i = 0; i < numel; ++i) {
    if (values[i] != ElementValue(chunk, first + i)) {
      return ::testing::AssertionFailure()
             << "element " << i << " is " << values[i] << ", not chunk " << chunk << "'s "
             << ElementValue(chunk, first + i);
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace strata::offload::testing
