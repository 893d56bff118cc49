// Tests for strata/offload/device_sizing.h: the device budget each DeviceFit sizes, by hand.

#include "strata/offload/device_sizing.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/core/tier.h"
#include "strata/offload/chunk_layout.h"

namespace strata::offload {
namespace {

constexpr uint64_t kSlack = 16 * kMiB;

ParameterSpec Param(std::string name, std::vector<int64_t> shape, bool frozen = false) {
  ParameterSpec spec;
  spec.name = std::move(name);
  spec.shape = std::move(shape);
  spec.frozen = frozen;
  return spec;
}

/// fp32 in chunks of 16 KiB (4096 elements): a full chunk, a frozen full chunk and a half one.
/// Device bytes: 32 KiB, 32 KiB, 16 KiB (parameters and gradients); state bytes (12 a trainable
/// element): 48 KiB, none, 24 KiB.
class DeviceSizingTest : public ::testing::Test {
 protected:
  DeviceSizingTest() {
    options_.precision.working_dtype = DType::kFp32;
    options_.placement.chunk_bytes = 16 * kKiB;
  }

  uint64_t Fit(DeviceFit fit, int ranks = 1) {
    Result<uint64_t> bytes = DeviceBytesToFit(options_, parameters_, fit, ranks);
    EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
    return bytes.ok() ? *bytes : 0;
  }

  EngineOptions options_;
  std::vector<ParameterSpec> parameters_ = {Param("a", {64, 64}), Param("b", {4096}, true),
                                            Param("c", {2048})};
};

TEST_F(DeviceSizingTest, TheLayoutIsTheOneTheCasesCount) {
  Result<ChunkLayout> layout = ChunkLayout::Build(parameters_, DType::kFp32, 16 * kKiB);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  ASSERT_EQ(layout->chunk_count(), 3u);
  EXPECT_EQ(layout->chunk(0).numel, 4096u);
  EXPECT_EQ(layout->chunk(1).numel, 4096u);
  EXPECT_TRUE(layout->chunk(1).frozen);
  EXPECT_EQ(layout->chunk(2).numel, 2048u);
}

TEST_F(DeviceSizingTest, AllChunksWithStatesOffHoldsChunksAndTwoOfStaging) {
  // Every chunk's parameters and gradients, two of the largest for staging, no states.
  EXPECT_EQ(Fit(DeviceFit::kAllChunks), (32 + 32 + 16) * kKiB + 2 * 32 * kKiB + kSlack);
  // Where the parameters live does not matter to it.
  options_.placement.params = Tier::kNvme;
  EXPECT_EQ(Fit(DeviceFit::kAllChunks), (32 + 32 + 16) * kKiB + 2 * 32 * kKiB + kSlack);
}

TEST_F(DeviceSizingTest, AllChunksHoldsTheStatesTheDeviceKeepsAndOneMoreChunks) {
  options_.placement.optimizer_states = Tier::kDevice;
  // The trainable chunks' states (the frozen one has none) and the largest chunk's once more.
  EXPECT_EQ(Fit(DeviceFit::kAllChunks),
            (32 + 32 + 16) * kKiB + (48 + 24) * kKiB + 48 * kKiB + 2 * 32 * kKiB + kSlack);
}

TEST_F(DeviceSizingTest, AllChunksHoldsTheShareOfStatesNotOffloaded) {
  options_.placement.optimizer_states = Tier::kHost;
  options_.placement.offload_ratio = 0.5;
  EXPECT_EQ(Fit(DeviceFit::kAllChunks),
            (32 + 32 + 16) * kKiB + (48 + 24) * kKiB / 2 + 48 * kKiB + 2 * 32 * kKiB + kSlack);
}

TEST_F(DeviceSizingTest, PlacementWithOffloadedParametersHoldsThreeOfTheLargestChunk) {
  for (Tier params : {Tier::kHost, Tier::kNvme}) {
    options_.placement.params = params;
    EXPECT_EQ(Fit(DeviceFit::kPlacement), 3 * 32 * kKiB) << TierName(params);
  }
}

TEST_F(DeviceSizingTest, PlacementWithParametersOnTheDeviceHoldsTwiceTheModel) {
  options_.placement.params = Tier::kDevice;
  // Twice each element's 4 bytes of fp32 and 12 of states, frozen ones included.
  EXPECT_EQ(Fit(DeviceFit::kPlacement), 2 * (4096 + 4096 + 2048) * (4 + 12) + kSlack);
}

TEST_F(DeviceSizingTest, RanksPadTheChunksCounted) {
  // Three ranks pad every chunk to a multiple of 3 x 1024 elements: 6144 and 3072.
  options_.placement.params = Tier::kHost;
  EXPECT_EQ(Fit(DeviceFit::kPlacement, 3), 3 * ChunkDeviceBytes(6144, DType::kFp32));
  EXPECT_EQ(ChunkDeviceBytes(6144, DType::kFp32), 48 * kKiB);
  options_.placement.params = Tier::kDevice;
  EXPECT_EQ(Fit(DeviceFit::kPlacement, 3), 2 * (6144 + 6144 + 3072) * (4 + 12) + kSlack);
}

TEST_F(DeviceSizingTest, ParametersTheLayoutRefusesAreItsError) {
  parameters_.push_back(Param("a", {8}));
  for (DeviceFit fit : {DeviceFit::kAllChunks, DeviceFit::kPlacement}) {
    Result<uint64_t> bytes = DeviceBytesToFit(options_, parameters_, fit);
    ASSERT_FALSE(bytes.ok());
    EXPECT_EQ(bytes.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(bytes.status().message().find("'a'"), std::string::npos) << bytes.status().message();
  }
}

}  // namespace
}  // namespace strata::offload
