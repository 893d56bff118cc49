// The MPI communicator across real ranks: ctest starts this binary under mpirun with three
// ranks (mpi_communicator_tests), and each rank runs every test; mpirun fails if any rank does.
// The tests run in the order written, the same on every rank, as collectives must.
#include "strata/offload/mpi_communicator.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "communicator_conformance.h"
#include "strata/core/dtype.h"
#include "strata/offload/ranks.h"

namespace strata::offload {
namespace {

std::unique_ptr<Communicator> Create(double timeout_seconds = 60.0) {
  auto created = CreateMpiCommunicator({.timeout_seconds = timeout_seconds});
  EXPECT_TRUE(created.ok()) << created.status().ToString();
  return created.ok() ? std::move(*created) : nullptr;
}

using testing::RunOne;

TEST(MpiCommunicatorTest, RankAndSizeAreTheLaunchersOnes) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  auto launched = DetectRanks();
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  EXPECT_EQ(launched->launcher, "mpirun");
  EXPECT_EQ(comm->rank(), launched->rank);
  EXPECT_EQ(comm->size(), launched->size);
  EXPECT_GE(comm->size(), 2) << "run under mpirun with several ranks";
}

TEST(MpiCommunicatorTest, AllReduceSumsAndMaxesInEveryDtype) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  testing::ExpectAllReduceSumsAndMaxesInEveryDtype(*comm);
}

TEST(MpiCommunicatorTest, ReduceScatterLeavesEachRankItsShardOfTheSum) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  testing::ExpectReduceScatterLeavesEachRankItsShardOfTheSum(*comm);
}

TEST(MpiCommunicatorTest, AllGatherPutsEveryRanksShardInRankOrder) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  testing::ExpectAllGatherPutsEveryRanksShardInRankOrder(*comm);
}

TEST(MpiCommunicatorTest, AllToAllSendsEachRankItsBlockOfEveryRank) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  testing::ExpectAllToAllSendsEachRankItsBlockOfEveryRank(*comm);
}

TEST(MpiCommunicatorTest, CollectivesRunInOrderEachAfterItsInputIsReady) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  testing::ExpectCollectivesRunInOrderEachAfterItsInputIsReady(*comm);
}

// An input that fails (a device error, say) fails its collective without running it, and
// every collective after it reports the same error: ranks that went on would disagree about
// which collective comes next.
TEST(MpiCommunicatorTest, AFailedInputFailsEveryLaterCollective) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  std::vector<double> values = {1.0};
  Status first = RunOne([&](CollectiveDone done) {
    comm->AllReduceScalars(
        values, ReduceOp::kSum, [] { return IoError("the gradients never arrived"); },
        std::move(done));
  });
  EXPECT_EQ(first.code(), StatusCode::kIoError);
  Status later = comm->AllReduceSum(values);
  EXPECT_EQ(later.code(), StatusCode::kIoError);
  EXPECT_NE(later.message().find("the gradients never arrived"), std::string::npos);
  EXPECT_EQ(values[0], 1.0);
}

// Strata initializes MPI for every thread, so a trainer that uses MPI afterwards (mpi4py,
// torch's MPI backend) may call it from its own.
TEST(MpiCommunicatorTest, MpiIsInitializedForEveryThread) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  int provided = MPI_THREAD_SINGLE;
  ASSERT_EQ(MPI_Query_thread(&provided), MPI_SUCCESS);
  EXPECT_EQ(provided, MPI_THREAD_MULTIPLE);
}

// MPI counts are ints: a larger collective is refused on every rank alike, in its turn, not
// truncated into a partial one that reports success.
TEST(MpiCommunicatorTest, CountsBeyondAnIntAreRefused) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  std::vector<float> data(8, 1.0f);
  const size_t huge = (size_t(1) << 32) + 8;
  Status status = RunOne([&](CollectiveDone done) {
    comm->AllReduce(data.data(), huge, DType::kFp32, ReduceOp::kSum, {}, std::move(done));
  });
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_NE(status.message().find("4294967304"), std::string::npos) << status.message();
  EXPECT_EQ(data[0], 1.0f);
}

// An exception from a ready function fails its collective (and so the communicator), instead
// of ending the process.
TEST(MpiCommunicatorTest, AReadyFunctionThatThrowsFailsItsCollective) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  std::vector<double> values = {1.0};
  Status status = RunOne([&](CollectiveDone done) {
    comm->AllReduceScalars(
        values, ReduceOp::kSum, []() -> Status { throw std::runtime_error("no gradients"); },
        std::move(done));
  });
  EXPECT_EQ(status.code(), StatusCode::kInternal);
  EXPECT_NE(status.message().find("no gradients"), std::string::npos) << status.message();
}

// The last owner of a communicator may be a done callback, which runs on the MPI thread: the
// communicator goes without deadlocking that thread, and others still work.
TEST(MpiCommunicatorTest, ACommunicatorReleasedByItsLastCallbackGoesQuietly) {
  std::shared_ptr<Communicator> comm = Create();
  ASSERT_NE(comm, nullptr);
  std::vector<double> values = {1.0};
  std::promise<Status> finished;
  auto result = finished.get_future();
  comm->AllReduceScalars(values, ReduceOp::kSum, {},
                         [&finished, owner = comm](Status s) { finished.set_value(s); });
  comm.reset();  // The callback holds the last reference.
  ASSERT_EQ(result.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_TRUE(result.get().ok());
  auto other = Create();
  ASSERT_NE(other, nullptr);
  std::vector<double> more = {2.0};
  std::promise<Status> again;
  auto again_result = again.get_future();
  other->AllReduceScalars(more, ReduceOp::kSum, {},
                          [&again](Status s) { again.set_value(std::move(s)); });
  ASSERT_EQ(again_result.wait_for(std::chrono::seconds(30)), std::future_status::ready)
      << "the MPI thread is stuck";
  EXPECT_TRUE(again_result.get().ok());
  EXPECT_EQ(more[0], 2.0 * other->size());
}

// Last, since it leaves the communicator failed: the last rank joins a collective only after
// the others' timeout, which turns the wait into an error naming the collective (not a hang).
// Its buffer outlives the test: MPI completes the collective once the late rank joins.
TEST(MpiCommunicatorTest, APeerThatNeverJoinsIsAnErrorAfterTheTimeout) {
  auto comm = Create(/*timeout_seconds=*/0.5);
  ASSERT_NE(comm, nullptr);
  // MPI may write it as late as the process's exit.
  static auto& values = *new std::vector<double>{1.0};
  const bool late = comm->rank() == comm->size() - 1;
  if (late) std::this_thread::sleep_for(std::chrono::seconds(2));
  const auto start = std::chrono::steady_clock::now();
  Status status = comm->AllReduceSum(values);
  if (late) return;  // The others waited for it long enough to give up.
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
  EXPECT_NE(status.message().find("collective #1 (all-reduce of 1 step scalars)"),
            std::string::npos)
      << status.message();
  EXPECT_NE(status.message().find("did not complete within 0.5 s"), std::string::npos)
      << status.message();
  EXPECT_GE(waited, 0.5);
  EXPECT_LT(waited, 1.9);
  EXPECT_EQ(comm->AllReduceSum(values).code(), StatusCode::kUnavailable);
}

TEST(MpiCommunicatorTest, BadOptionsAreRefused) {
  auto zero = CreateMpiCommunicator({.timeout_seconds = 0});
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::offload
