// Chunk's storage transitions that change several fields at once (engine/chunk.h). What the
// step keeps per chunk is tested in chunk_step_test.cpp.
#include "engine/chunk.h"

#include <gtest/gtest.h>

#include "chunk_placement.h"

namespace strata::offload {
namespace {

using testing::Place;

TEST(ChunkTest, FlipNvmeShadowsFlipsOnlyWhatLivesOnNvme) {
  Chunk both;
  Place(both, Tier::kNvme, Tier::kNvme);
  EXPECT_EQ(both.state_extent().index, 10u);
  EXPECT_EQ(both.state_shadow().index, 11u);
  both.FlipNvmeShadows();
  EXPECT_EQ(both.state_extent().index, 11u);
  EXPECT_EQ(both.state_shadow().index, 10u);
  EXPECT_EQ(both.param_extent().index, 21u);
  both.FlipNvmeShadows();  // And back: the old current extents are the next shadows.
  EXPECT_EQ(both.state_extent().index, 10u);
  EXPECT_EQ(both.param_extent().index, 20u);

  Chunk states_only;
  Place(states_only, Tier::kNvme, Tier::kDevice);
  states_only.FlipNvmeShadows();
  EXPECT_EQ(states_only.state_extent().index, 11u);
  EXPECT_EQ(states_only.param_extent().index, 20u);
}

}  // namespace
}  // namespace strata::offload
