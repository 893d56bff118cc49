#include "engine/host_memory.h"

#include <gtest/gtest.h>

namespace strata::offload {
namespace {

TEST(HostMemoryTest, AutomaticStateBuffersCoverEveryNvmeChunkWithinTheirRoom) {
  const HostOptions automatic;  // optimizer_buffer_count 0.
  const uint64_t buffer = 48 << 20;
  // Room for all: one per chunk and a spare.
  EXPECT_EQ(StateBufferCount(automatic, 16, buffer, uint64_t(64) << 30), 17);
  // 256 MiB holds 5 of them.
  EXPECT_EQ(StateBufferCount(automatic, 16, buffer, uint64_t(256) << 20), 5);
  // Never fewer than DeepSpeed's 4, which the budget always holds room for (MinStateBuffers).
  EXPECT_EQ(StateBufferCount(automatic, 16, buffer, 0), kMinStateBuffers);
  EXPECT_EQ(StateBufferCount(automatic, 1, buffer, uint64_t(64) << 30), kMinStateBuffers);
  EXPECT_EQ(MinStateBuffers(automatic), kMinStateBuffers);
  // A set count (a DeepSpeed buffer_count) is used as given.
  const HostOptions set{.optimizer_buffer_count = 2};
  EXPECT_EQ(StateBufferCount(set, 16, buffer, uint64_t(64) << 30), 2);
  EXPECT_EQ(MinStateBuffers(set), 2);
}

// Staging takes what the budget has left, less what speculative updates would keep there, and
// at least a quarter of it.
TEST(HostMemoryTest, StagingRoomIsTheFreeMemorySpeculationDoesNotWant) {
  const uint64_t free = uint64_t(4) << 30;
  EXPECT_EQ(StateStagingRoom(free, 0), free);  // Steps not gated: all of it.
  EXPECT_EQ(StateStagingRoom(free, uint64_t(1) << 30), uint64_t(3) << 30);
  EXPECT_EQ(StateStagingRoom(free, uint64_t(4) << 30), uint64_t(1) << 30);   // A quarter.
  EXPECT_EQ(StateStagingRoom(free, uint64_t(64) << 30), uint64_t(1) << 30);  // Still a quarter.
  EXPECT_EQ(StateStagingRoom(0, uint64_t(1) << 30), 0u);
}

TEST(HostMemoryTest, TheBudgetIsThePinnedBytesSetOrMostOfPhysicalMemory) {
  EngineOptions options;
  options.host.pinned_memory_bytes = 12345;
  EXPECT_EQ(HostBudgetBytes(options), 12345u);
  EXPECT_EQ(HostBudgetBytes(options, 8), 12345u);  // Set per rank.
  options.host.pinned_memory_bytes = 0;
  EXPECT_GT(HostBudgetBytes(options), 0u);
  EXPECT_EQ(HostBudgetBytes(options, 8), HostBudgetBytes(options) / 8);
}

TEST(HostMemoryTest, OptimizerThreadsAreSetOrTheNodesSharedEvenly) {
  EngineOptions options;
  options.optimizer.cpu_threads = 3;
  EXPECT_EQ(OptimizerThreads(options, 8), 3);
  options.optimizer.cpu_threads = 0;
  const int all = OptimizerThreads(options);
  EXPECT_GE(all, 1);
  EXPECT_EQ(OptimizerThreads(options, 2), std::max(1, all / 2));
  EXPECT_EQ(OptimizerThreads(options, 1 << 20), 1);
}

}  // namespace
}  // namespace strata::offload
