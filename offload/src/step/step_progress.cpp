#include "step/step_progress.h"

#include <cstdio>
#include <cstdlib>

namespace strata::offload {

const char* StepProgressName(StepProgress progress) {
  using P = StepProgress;
  switch (progress) {
    case P::kCollecting: return "collecting";
    case P::kRequested: return "requested";
    case P::kRechecking: return "rechecking";
    case P::kCommitting: return "committing";
    case P::kCommitted: return "committed";
    case P::kFinishing: return "finishing";
    case P::kFinishingCommitted: return "finishing-committed";
    case P::kFailed: return "failed";
    case P::kFailedCommitted: return "failed-committed";
    case P::kRetryingUploads: return "retrying-uploads";
    case P::kCancelled: return "cancelled";
  }
  return "unknown";
}

bool StepProgressAllows(StepProgress from, StepProgress to) {
  using P = StepProgress;
  switch (to) {
    // A step completed: its commit (one rank), or the agreement of every rank's outcome.
    case P::kCollecting:
      return from == P::kCommitting || from == P::kCommitted || from == P::kFinishing ||
             from == P::kFinishingCommitted;
    // Step(), the first time or the retry of an attempt that failed before the flip; and the
    // end of a recheck.
    case P::kRequested:
      return from == P::kCollecting || from == P::kFailed || from == P::kRechecking;
    case P::kRechecking: return from == P::kRequested;
    case P::kCommitting: return from == P::kRequested;
    // The flip, or the commit of a retry that only uploads (flipped by the attempt before).
    case P::kCommitted: return from == P::kCommitting || from == P::kRetryingUploads;
    case P::kFinishing: return from == P::kRequested || from == P::kCommitting;
    case P::kFinishingCommitted: return from == P::kCommitted || from == P::kRetryingUploads;
    case P::kFailed:
      return from == P::kRequested || from == P::kCommitting || from == P::kFinishing;
    case P::kFailedCommitted:
      return from == P::kCommitted || from == P::kRetryingUploads ||
             from == P::kFinishingCommitted;
    case P::kRetryingUploads: return from == P::kFailedCommitted;
    case P::kCancelled:
      return from == P::kCollecting || from == P::kFailed || from == P::kFailedCommitted;
  }
  return false;
}

void Advance(StepProgress& progress, StepProgress to) {
  if (!StepProgressAllows(progress, to)) {
    std::fprintf(stderr, "strata: internal error: a step moved from %s to %s\n",
                 StepProgressName(progress), StepProgressName(to));
    std::abort();
  }
  progress = to;
}

}  // namespace strata::offload
