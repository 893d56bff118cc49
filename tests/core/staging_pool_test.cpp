#include "strata/core/staging_pool.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <future>
#include <set>
#include <thread>

#include "strata/core/host_device.h"

namespace strata {
namespace {

TEST(StagingPoolTest, BuffersAreAlignedDistinctAndReturned) {
  auto pool = StagingPool::Create({.buffer_bytes = 10000, .buffer_count = 3});
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->buffer_bytes(), 12288u);  // Rounded up to 4 KiB.
  {
    StagingBuffer a = (*pool)->Acquire();
    StagingBuffer b = (*pool)->Acquire();
    StagingBuffer c = (*pool)->Acquire();
    std::set<std::byte*> seen;
    for (const StagingBuffer* buffer : {&a, &b, &c}) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % kHostAlignment, 0u);
      EXPECT_EQ(buffer->size(), 12288u);
      seen.insert(buffer->data());
    }
    EXPECT_EQ(seen.size(), 3u);
    EXPECT_EQ((*pool)->available(), 0u);
    auto none = (*pool)->TryAcquire();
    ASSERT_FALSE(none.ok());
    EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(none.status().message().find("all 3 buffers"), std::string::npos);
  }
  EXPECT_EQ((*pool)->available(), 3u);
}

TEST(StagingPoolTest, NeverExceedsBudget) {
  auto pool =
      StagingPool::Create({.buffer_bytes = 1 << 20, .buffer_count = 5, .budget_bytes = 4 << 20});
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(pool.status().message().find("need 5MiB but the pinned host budget is 4MiB"),
            std::string::npos)
      << pool.status().message();
  EXPECT_TRUE(
      StagingPool::Create({.buffer_bytes = 1 << 20, .buffer_count = 4, .budget_bytes = 4 << 20})
          .ok());
}

TEST(StagingPoolTest, RejectsEmptyPool) {
  EXPECT_EQ(StagingPool::Create({.buffer_bytes = 4096, .buffer_count = 0}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(StagingPool::Create({.buffer_bytes = 0, .buffer_count = 2}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(StagingPoolTest, AcquireWaitsForReturn) {
  auto pool = *StagingPool::Create({.buffer_bytes = 4096, .buffer_count = 1});
  StagingBuffer held = pool->Acquire();
  const size_t held_index = held.index();
  std::promise<void> acquiring;
  auto waiter = std::async(std::launch::async, [&] {
    acquiring.set_value();
    return pool->Acquire().index();
  });
  acquiring.get_future().wait();
  // The waiter cannot finish while the only buffer is held.
  EXPECT_EQ(waiter.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  held.Reset();
  EXPECT_EQ(waiter.get(), held_index);
}

TEST(StagingPoolTest, MovedBufferReturnsOnce) {
  auto pool = *StagingPool::Create({.buffer_bytes = 4096, .buffer_count = 2});
  StagingBuffer a = pool->Acquire();
  StagingBuffer b = std::move(a);
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): checking the moved-from state.
  EXPECT_TRUE(b.valid());
  EXPECT_EQ(pool->available(), 1u);
  b = StagingBuffer();
  EXPECT_EQ(pool->available(), 2u);
}

TEST(StagingPoolTest, PinsThroughDevice) {
  auto device = *CreateHostDevice();
  auto pool =
      StagingPool::Create({.buffer_bytes = 8192, .buffer_count = 2, .pin_with = device.get()});
  ASSERT_TRUE(pool.ok());
  EXPECT_TRUE((*pool)->pinned());
  EXPECT_EQ((*pool)->arena().size(), 16384u);
}

TEST(StagingPoolTest, ConcurrentUseNeverSharesABuffer) {
  auto pool = *StagingPool::Create({.buffer_bytes = 4096, .buffer_count = 3});
  std::atomic<int> in_use[3] = {0, 0, 0};
  std::atomic<bool> shared{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) {
        StagingBuffer buffer = pool->Acquire();
        if (in_use[buffer.index()].fetch_add(1) != 0) shared = true;
        in_use[buffer.index()].fetch_sub(1);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_FALSE(shared.load());
  EXPECT_EQ(pool->available(), 3u);
}

}  // namespace
}  // namespace strata
