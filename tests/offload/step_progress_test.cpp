// The step's progress (step/step_progress.h): the moves a step makes, in the order a trainer's
// calls and their failures make them, and the aborts on a move it never makes.
#include "step/step_progress.h"

#include <gtest/gtest.h>

namespace strata::offload {
namespace {

using P = StepProgress;

TEST(StepProgressTest, AStepThatCommitsComesBackToCollecting) {
  P p = P::kCollecting;
  for (P to : {P::kRequested, P::kRechecking, P::kRequested, P::kCommitting, P::kCommitted,
               P::kCollecting}) {
    Advance(p, to);
  }
  EXPECT_EQ(p, P::kCollecting);
  // A skipped fp16 step commits without flipping anything.
  for (P to : {P::kRequested, P::kCommitting, P::kCollecting}) Advance(p, to);
  EXPECT_EQ(p, P::kCollecting);
}

TEST(StepProgressTest, ARetryAfterTheFlipOnlyUploadsAgain) {
  P p = P::kCommitted;
  Advance(p, P::kFailedCommitted);
  EXPECT_TRUE(Flipped(p));
  EXPECT_FALSE(Requested(p));
  Advance(p, P::kRetryingUploads);
  EXPECT_TRUE(Requested(p));
  EXPECT_FALSE(CommitBegun(p));
  // Its commit starts flipped: no second flip, and a failure keeps it flipped.
  EXPECT_FALSE(StepProgressAllows(p, P::kCommitting));
  Advance(p, P::kCommitted);
  EXPECT_TRUE(CommitBegun(p));
  Advance(p, P::kFailedCommitted);
  // A failure before the flip retries everything left.
  P q = P::kCommitting;
  Advance(q, P::kFailed);
  EXPECT_FALSE(Flipped(q));
  Advance(q, P::kRequested);
}

TEST(StepProgressTest, SeveralRanksWaitForTheOthersOnEitherSideOfTheFlip) {
  P before = P::kRequested;
  Advance(before, P::kFinishing);
  EXPECT_TRUE(CommitBegun(before));
  Advance(before, P::kFailed);
  P after = P::kCommitted;
  Advance(after, P::kFinishingCommitted);
  EXPECT_TRUE(Flipped(after));
  Advance(after, P::kCollecting);
}

TEST(StepProgressTest, OnlyAStepNotAskedForIsCancelled) {
  for (P p : {P::kCollecting, P::kFailed, P::kFailedCommitted}) {
    EXPECT_TRUE(StepProgressAllows(p, P::kCancelled)) << StepProgressName(p);
  }
  for (P p : {P::kRequested, P::kRechecking, P::kCommitting, P::kCommitted, P::kFinishing,
              P::kRetryingUploads, P::kCancelled}) {
    EXPECT_FALSE(StepProgressAllows(p, P::kCancelled)) << StepProgressName(p);
  }
}

TEST(StepProgressDeathTest, AMoveTheStepNeverMakesAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  P p = P::kCollecting;
  EXPECT_DEATH(Advance(p, P::kCommitted), "a step moved from collecting to committed");
  p = P::kCommitted;
  EXPECT_DEATH(Advance(p, P::kCommitting), "a step moved from committed to committing");
}

}  // namespace
}  // namespace strata::offload
