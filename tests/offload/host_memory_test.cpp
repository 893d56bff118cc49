#include "host_memory.h"

#include <gtest/gtest.h>

namespace strata::offload {
namespace {

TEST(HostMemoryTest, AutomaticStateBuffersCoverEveryNvmeChunkWithinAQuarterOfTheFreeMemory) {
  const HostOptions automatic;  // optimizer_buffer_count 0.
  const uint64_t buffer = 48 << 20;
  // Room for all: one per chunk and a spare.
  EXPECT_EQ(StateBufferCount(automatic, 16, buffer, uint64_t(64) << 30), 17);
  // A quarter of 1 GiB holds 5 of them.
  EXPECT_EQ(StateBufferCount(automatic, 16, buffer, uint64_t(1) << 30), 5);
  // Never fewer than DeepSpeed's 4, which the budget always holds room for (MinStateBuffers).
  EXPECT_EQ(StateBufferCount(automatic, 16, buffer, 0), kMinStateBuffers);
  EXPECT_EQ(StateBufferCount(automatic, 1, buffer, uint64_t(64) << 30), kMinStateBuffers);
  EXPECT_EQ(MinStateBuffers(automatic), kMinStateBuffers);
  // A set count (a DeepSpeed buffer_count) is used as given.
  const HostOptions set{.optimizer_buffer_count = 2};
  EXPECT_EQ(StateBufferCount(set, 16, buffer, uint64_t(64) << 30), 2);
  EXPECT_EQ(MinStateBuffers(set), 2);
}

TEST(HostMemoryTest, TheBudgetIsThePinnedBytesSetOrMostOfPhysicalMemory) {
  EngineOptions options;
  options.host.pinned_memory_bytes = 12345;
  EXPECT_EQ(HostBudgetBytes(options), 12345u);
  options.host.pinned_memory_bytes = 0;
  EXPECT_GT(HostBudgetBytes(options), 0u);
}

}  // namespace
}  // namespace strata::offload
