// What the step keeps per chunk (step/chunk_step.h): the transitions that change several of its
// fields, or the chunk's storage with them, at once.
#include "step/chunk_step.h"

#include <gtest/gtest.h>

#include "chunk_placement.h"

namespace strata::offload {
namespace {

using testing::Place;

TEST(ChunkStepTest, MakeUpdateCurrentSwapsHostHomesAndShadows) {
  Chunk c;
  ChunkStep s;
  Place(c, Tier::kHost, Tier::kHost);
  c.host_params = *AlignedBuffer::Allocate(4096);
  c.param_copy = *AlignedBuffer::Allocate(4096);
  c.host_states = *AlignedBuffer::Allocate(4096);
  c.host_state_shadow = *AlignedBuffer::Allocate(4096);
  std::byte* const new_params = c.param_copy.data();
  std::byte* const new_states = c.host_state_shadow.data();
  std::byte* const old_states = c.host_states.data();
  s.states_in_shadow = true;
  s.MakeUpdateCurrent(c);
  EXPECT_EQ(c.host_params.data(), new_params);
  EXPECT_EQ(c.host_states.data(), new_states);
  EXPECT_FALSE(s.states_in_shadow);
  // Without new states in the shadow, the host states stay.
  s.MakeUpdateCurrent(c);
  EXPECT_EQ(c.host_states.data(), new_states);
  EXPECT_NE(c.host_states.data(), old_states);
}

TEST(ChunkStepTest, MakeUpdateCurrentFlipsNvmeShadows) {
  Chunk c;
  ChunkStep s;
  Place(c, Tier::kNvme, Tier::kNvme);
  s.MakeUpdateCurrent(c);
  EXPECT_EQ(c.state_extent().index, 11u);
  EXPECT_EQ(c.param_extent().index, 21u);
}

TEST(ChunkStepTest, EndStepResetsTheStepAndCountsAnUpdate) {
  ChunkStep s;
  s.MoveTo(ChunkPhase::kLanding);
  s.MoveTo(ChunkPhase::kArrived);
  s.MoveTo(ChunkPhase::kUpdating);
  s.MoveTo(ChunkPhase::kUpdated);
  s.micro_steps = 2;
  s.params_uploaded = true;
  s.update_at_commit = true;
  s.gathered = true;
  s.restore_params = true;
  s.stats.sum_of_squares = 4.0;
  s.land_status = Internal("landing failed");
  s.EndStep(/*updated=*/true);
  EXPECT_EQ(s.phase_now(), ChunkPhase::kIdle);
  EXPECT_EQ(s.micro_steps, 0);
  EXPECT_EQ(s.steps_taken, 1);
  EXPECT_FALSE(s.params_uploaded);
  EXPECT_FALSE(s.update_at_commit);
  EXPECT_FALSE(s.restore_params);
  EXPECT_EQ(s.stats.sum_of_squares, 0.0);
  EXPECT_FALSE(s.gathered);
  EXPECT_TRUE(s.land_status.ok());

  // A skipped step ends it without counting an update.
  s.MoveTo(ChunkPhase::kLanding);
  s.MoveTo(ChunkPhase::kArrived);
  s.EndStep(/*updated=*/false);
  EXPECT_EQ(s.phase_now(), ChunkPhase::kIdle);
  EXPECT_EQ(s.steps_taken, 1);
}

}  // namespace
}  // namespace strata::offload
