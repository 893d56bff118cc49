// Test helper: a chunk placed by hand, for the tests of Chunk's and ChunkStep's transitions.
#pragma once

#include "engine/chunk.h"

namespace strata::offload::testing {

/// Places `c`'s states and parameters where `states` and `params` say, with distinct current
/// and shadow extents. (Chunks do not move: the engine makes them in place.)
inline void Place(Chunk& c, Tier states, Tier params) {
  c.placement = {.params = params, .optimizer_states = states};
  c.state_extents[0] = {.index = 10};
  c.state_extents[1] = {.index = 11};
  c.param_extents[0] = {.index = 20};
  c.param_extents[1] = {.index = 21};
}

}  // namespace strata::offload::testing
