// Chunk's transitions that change several fields at once (engine/chunk.h).
#include "engine/chunk.h"

#include <gtest/gtest.h>

namespace strata::offload {
namespace {

/// Places `c`'s states and parameters where `states` and `params` say, with distinct current
/// and shadow extents. (Chunks do not move: the engine makes them in place.)
void Place(Chunk& c, Tier states, Tier params) {
  c.placement = {.params = params, .optimizer_states = states};
  c.state_extents[0] = {.index = 10};
  c.state_extents[1] = {.index = 11};
  c.param_extents[0] = {.index = 20};
  c.param_extents[1] = {.index = 21};
}

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

TEST(ChunkTest, MakeUpdateCurrentSwapsHostHomesAndShadows) {
  Chunk c;
  Place(c, Tier::kHost, Tier::kHost);
  c.host_params = *AlignedBuffer::Allocate(4096);
  c.param_copy = *AlignedBuffer::Allocate(4096);
  c.host_states = *AlignedBuffer::Allocate(4096);
  c.host_state_shadow = *AlignedBuffer::Allocate(4096);
  std::byte* const new_params = c.param_copy.data();
  std::byte* const new_states = c.host_state_shadow.data();
  std::byte* const old_states = c.host_states.data();
  c.states_in_shadow = true;
  c.MakeUpdateCurrent();
  EXPECT_EQ(c.host_params.data(), new_params);
  EXPECT_EQ(c.host_states.data(), new_states);
  EXPECT_FALSE(c.states_in_shadow);
  // Without new states in the shadow, the host states stay.
  c.MakeUpdateCurrent();
  EXPECT_EQ(c.host_states.data(), new_states);
  EXPECT_NE(c.host_states.data(), old_states);
}

TEST(ChunkTest, EndStepResetsTheStepAndCountsAnUpdate) {
  Chunk c;
  Place(c, Tier::kHost, Tier::kDevice);
  c.MoveTo(ChunkPhase::kLanding);
  c.MoveTo(ChunkPhase::kArrived);
  c.MoveTo(ChunkPhase::kUpdating);
  c.MoveTo(ChunkPhase::kUpdated);
  c.micro_steps = 2;
  c.params_uploaded = true;
  c.update_at_commit = true;
  c.gathered = true;
  c.land_status = Internal("landing failed");
  c.EndStep(/*updated=*/true);
  EXPECT_EQ(c.phase_now(), ChunkPhase::kIdle);
  EXPECT_EQ(c.micro_steps, 0);
  EXPECT_EQ(c.steps_taken, 1);
  EXPECT_FALSE(c.params_uploaded);
  EXPECT_FALSE(c.update_at_commit);
  EXPECT_FALSE(c.gathered);
  EXPECT_TRUE(c.land_status.ok());

  // A skipped step ends it without counting an update.
  c.MoveTo(ChunkPhase::kLanding);
  c.MoveTo(ChunkPhase::kArrived);
  c.EndStep(/*updated=*/false);
  EXPECT_EQ(c.phase_now(), ChunkPhase::kIdle);
  EXPECT_EQ(c.steps_taken, 1);
}

}  // namespace
}  // namespace strata::offload
