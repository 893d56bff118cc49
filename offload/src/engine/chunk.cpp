// A chunk's phase moves: the one place that says which moves the step allows (chunk.h).
#include "engine/chunk.h"

#include <cstdio>
#include <cstdlib>

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

void Chunk::MoveTo(ChunkPhase to) {
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
  phase.store(to, std::memory_order_release);
}

}  // namespace strata::offload
