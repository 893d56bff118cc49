// A chunk's storage transitions: the moves that change several of its fields at once (chunk.h).
#include "engine/chunk.h"

namespace strata::offload {

void Chunk::FlipNvmeShadows() {
  if (placement.optimizer_states == Tier::kNvme) state_current_ = 1 - state_current_;
  if (placement.params == Tier::kNvme) param_current_ = 1 - param_current_;
}

}  // namespace strata::offload
