// A chunk's part in the step: the phase moves the step allows (chunk_step.h), and the moves
// that change several of its fields at once.
#include "step/chunk_step.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

namespace strata::offload {

const char* ChunkPhaseName(ChunkPhase phase) {
  switch (phase) {
    case ChunkPhase::kIdle: return "idle";
    case ChunkPhase::kAccumulating: return "accumulating";
    case ChunkPhase::kLanding: return "landing";
    case ChunkPhase::kArrived: return "arrived";
    case ChunkPhase::kUpdating: return "updating";
    case ChunkPhase::kStepped: return "stepped";
    case ChunkPhase::kUpdated: return "updated";
  }
  return "unknown";
}

void ChunkStep::MoveTo(ChunkPhase to) {
  using P = ChunkPhase;
  const P from = phase_now();
  bool allowed = false;
  switch (to) {
    case P::kIdle: allowed = from == P::kArrived || from == P::kUpdated; break;  // The commit.
    case P::kAccumulating: allowed = from == P::kIdle || from == P::kAccumulating; break;
    case P::kLanding: allowed = from == P::kIdle || from == P::kAccumulating; break;
    // The journey, a failed update, or the verdict rolling a speculative update back.
    case P::kArrived:
      allowed = from == P::kLanding || from == P::kUpdating || from == P::kUpdated;
      break;
    case P::kUpdating: allowed = from == P::kArrived || from == P::kStepped; break;
    case P::kStepped: allowed = from == P::kUpdating; break;
    case P::kUpdated: allowed = from == P::kUpdating; break;
  }
  if (!allowed) {
    std::fprintf(stderr, "strata: internal error: a chunk moved from %s to %s\n",
                 ChunkPhaseName(from), ChunkPhaseName(to));
    std::abort();
  }
  phase_.store(to, std::memory_order_release);
}

void ChunkStep::MakeUpdateCurrent(Chunk& chunk) {
  chunk.FlipNvmeShadows();
  if (chunk.placement.params == Tier::kHost) std::swap(chunk.host_params, chunk.param_copy);
  if (states_in_shadow) {
    std::swap(chunk.host_states, chunk.host_state_shadow);
    states_in_shadow = false;
  }
}

void ChunkStep::EndStep(bool updated) {
  if (updated) ++steps_taken;
  MoveTo(ChunkPhase::kIdle);
  micro_steps = 0;
  stats = {};
  grads_changed = false;
  land_status = Status();
  params_uploaded = false;
  upload_at_release = false;
  restore_params = false;
  update_at_commit = false;
  gathered = false;
}

}  // namespace strata::offload
