// StepProgress: where the step as a whole stands, from its first gradients to the delivery of
// its outcome, and what a failed attempt leaves for its retry. One value instead of a flag per
// stage, so that no two stages can be true at once; every change goes through Advance, which
// aborts on a move the step does not make (as ChunkStep::MoveTo does for a chunk's phase).
//
//   kCollecting --Step()--> kRequested <--> kRechecking (optimizer.recheck_gradients)
//        |                     |   |
//      Cancel              commit  fails ------------------------------> kFailed
//        v                     v                                           | Step() again
//   kCancelled            kCommitting --flip--> kCommitted --done--> kCollecting
//                              | fails              | fails
//                              v                    v
//                           kFailed          kFailedCommitted --Step()--> kRetryingUploads
//                                                                           | the commit again
//                                                                           v (no second flip)
//                                                                        kCommitted
// Not drawn: a skipped fp16 step completes from kCommitting (nothing to flip); kFailed and
// kFailedCommitted may be cancelled at shutdown. Several ranks wait for every rank's outcome in
// kFinishing (before the flip) or kFinishingCommitted (after it), then complete or fail from
// there as one rank does. StepProgressAllows is the whole list.
#pragma once

#include <cstdint>

namespace strata::offload {

enum class StepProgress : uint8_t {
  kCollecting,           ///< Gradients arrive; Step() not called yet.
  kRequested,            ///< Step() called: chunks land, the verdict is made, updates run.
  kRechecking,           ///< Step() reads every chunk's gradients again (RecheckGradients).
  kCommitting,           ///< Commit runs; the shadows are not flipped yet.
  kCommitted,            ///< The commit flipped the shadows: the update is current.
  kFinishing,            ///< Several ranks: this rank's outcome, not committed, awaits theirs.
  kFinishingCommitted,   ///< The same after the flip.
  kFailed,               ///< The attempt failed before the flip: a retry redoes what is left.
  kFailedCommitted,      ///< It failed after the flip: a retry only uploads again.
  kRetryingUploads,      ///< Step() again after kFailedCommitted.
  kCancelled,            ///< Shutdown without Step(): journeys waiting for a verdict end.
};

/// "collecting", "requested", ... for messages.
const char* StepProgressName(StepProgress progress);

/// Whether the step moves from `from` to `to` (the diagram above).
bool StepProgressAllows(StepProgress from, StepProgress to);

/// `progress` becomes `to`, or the process aborts naming both: a move the step never makes is
/// a bug in the pipeline, and going on would commit or retry the wrong thing.
void Advance(StepProgress& progress, StepProgress to);

/// Step() was called and its outcome is not delivered yet.
constexpr bool Requested(StepProgress p) {
  return p != StepProgress::kCollecting && p != StepProgress::kFailed &&
         p != StepProgress::kFailedCommitted && p != StepProgress::kCancelled;
}

/// The commit has begun (or the outcome waits for the other ranks): nothing starts an update.
constexpr bool CommitBegun(StepProgress p) {
  return p == StepProgress::kCommitting || p == StepProgress::kCommitted ||
         p == StepProgress::kFinishing || p == StepProgress::kFinishingCommitted;
}

/// The shadows of this step's update were flipped current, by this attempt or one before.
constexpr bool Flipped(StepProgress p) {
  return p == StepProgress::kCommitted || p == StepProgress::kFinishingCommitted ||
         p == StepProgress::kFailedCommitted || p == StepProgress::kRetryingUploads;
}

}  // namespace strata::offload
