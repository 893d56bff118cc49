// Local communicators: ranks that are threads of one process. Each test runs one function per
// rank on threads of its own, as several engines of one test would.
#include "strata/offload/local_communicator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "comm/collective_peers.h"
#include "communicator_conformance.h"
#include "strata/core/dtype.h"

namespace strata::offload {
namespace {

using std::chrono::steady_clock;
using testing::Group;
using testing::OnEveryRank;
using testing::RunOne;

TEST(LocalCommunicatorTest, AllReduceSumsAndMaxesInEveryDtype) {
  OnEveryRank(Group(3), testing::ExpectAllReduceSumsAndMaxesInEveryDtype);
}

TEST(LocalCommunicatorTest, ReduceScatterLeavesEachRankItsShardOfTheSum) {
  OnEveryRank(Group(3), testing::ExpectReduceScatterLeavesEachRankItsShardOfTheSum);
}

TEST(LocalCommunicatorTest, AllGatherPutsEveryRanksShardInRankOrder) {
  OnEveryRank(Group(4), testing::ExpectAllGatherPutsEveryRanksShardInRankOrder);
}

TEST(LocalCommunicatorTest, AllToAllSendsEachRankItsBlockOfEveryRank) {
  OnEveryRank(Group(3), testing::ExpectAllToAllSendsEachRankItsBlockOfEveryRank);
}

// The single rank's collectives are copies (or nothing), done before the call returns.
TEST(SingleRankCommunicatorTest, CollectivesLeaveOrCopyTheData) {
  auto comm = CreateSingleRankCommunicator();
  testing::ExpectAllReduceSumsAndMaxesInEveryDtype(*comm);
  testing::ExpectReduceScatterLeavesEachRankItsShardOfTheSum(*comm);
  testing::ExpectAllGatherPutsEveryRanksShardInRankOrder(*comm);
  testing::ExpectAllToAllSendsEachRankItsBlockOfEveryRank(*comm);
}

TEST(LocalCommunicatorTest, CollectivesRunInOrderEachAfterItsInputIsReady) {
  OnEveryRank(Group(2), testing::ExpectCollectivesRunInOrderEachAfterItsInputIsReady);
}

// What MPI cannot check: ranks whose collectives diverged fail, naming both, on every rank.
TEST(LocalCommunicatorTest, RanksThatEnqueuedDifferentCollectivesFailNamingBoth) {
  auto group = Group(2);
  OnEveryRank(group, [&](Communicator& comm) {
    std::vector<float> data(comm.rank() == 0 ? 8 : 16, 1.0f);
    Status status = RunOne([&](CollectiveDone done) {
      comm.AllReduce(data.data(), data.size(), DType::kFp32, ReduceOp::kSum, {}, std::move(done));
    });
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find("all-reduce of 8 fp32 (sum)"), std::string::npos)
        << status.message();
    EXPECT_NE(status.message().find("all-reduce of 16 fp32 (sum)"), std::string::npos)
        << status.message();
    EXPECT_EQ(data[0], 1.0f);
  });
}

// An input that fails on one rank fails the collective on every rank at once (MPI's peers
// would wait for their timeout), and every later collective reports the first error.
TEST(LocalCommunicatorTest, AFailedInputFailsTheCollectiveOnEveryRankAndEveryLaterOne) {
  auto group = Group(3);
  OnEveryRank(group, [&](Communicator& comm) {
    std::vector<double> values = {1.0};
    const auto start = steady_clock::now();
    Status first = RunOne([&](CollectiveDone done) {
      CollectiveReady ready;
      if (comm.rank() == 1) ready = [] { return IoError("the gradients never arrived"); };
      comm.AllReduceScalars(values, ReduceOp::kSum, ready, std::move(done));
    });
    EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(10));
    EXPECT_FALSE(first.ok());
    EXPECT_NE(first.message().find("the gradients never arrived"), std::string::npos)
        << first.message();
    Status later = comm.AllReduceSum(values);
    EXPECT_EQ(later.code(), first.code());
    EXPECT_EQ(values[0], 1.0);
  });
}

TEST(LocalCommunicatorTest, AReadyFunctionThatThrowsFailsItsCollective) {
  auto group = Group(1);
  std::vector<double> values = {1.0};
  Status status = RunOne([&](CollectiveDone done) {
    group[0]->AllReduceScalars(
        values, ReduceOp::kSum, []() -> Status { throw std::runtime_error("no gradients"); },
        std::move(done));
  });
  EXPECT_EQ(status.code(), StatusCode::kInternal);
  EXPECT_NE(status.message().find("no gradients"), std::string::npos) << status.message();
}

// A rank whose communicator goes (its process died, in MPI terms) fails its peers' waits at
// once, naming it.
TEST(LocalCommunicatorTest, ARankThatLeavesFailsItsPeersWaitingForIt) {
  auto group = Group(3);
  group[2].reset();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::vector<double> values = {1.0};
      const auto start = steady_clock::now();
      Status status = group[size_t(r)]->AllReduceSum(values);
      EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(10));
      EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
      EXPECT_NE(status.message().find("rank 2 left the group"), std::string::npos)
          << status.message();
    });
  }
  for (std::thread& thread : threads) thread.join();
}

TEST(LocalCommunicatorTest, APeerThatNeverJoinsIsAnErrorAfterTheTimeout) {
  auto group = Group(2, /*timeout_seconds=*/0.3);
  std::vector<double> values = {1.0};
  const auto start = steady_clock::now();
  Status status = group[0]->AllReduceSum(values);
  const double waited = std::chrono::duration<double>(steady_clock::now() - start).count();
  ASSERT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
  EXPECT_NE(status.message().find("rank 0 of 2: collective #1"), std::string::npos)
      << status.message();
  EXPECT_NE(status.message().find("waited 0.3 s for rank(s) 1"), std::string::npos)
      << status.message();
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 5.0);
  EXPECT_EQ(group[0]->AllReduceSum(values).code(), StatusCode::kUnavailable);
}

TEST(LocalCommunicatorTest, BadOptionsAreRefused) {
  EXPECT_EQ(CreateLocalCommunicators({.size = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateLocalCommunicators({.size = 2, .timeout_seconds = 0}).status().code(),
            StatusCode::kInvalidArgument);
}

// Where each rank sits on its node: in rank order, the last node holding what is left; by
// default every rank on one node.
TEST(LocalCommunicatorTest, RanksKnowTheirPlaceOnTheirNode) {
  auto group = CreateLocalCommunicators({.size = 5, .ranks_per_node = 2});
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  const std::vector<std::pair<int, int>> expected = {{0, 2}, {1, 2}, {0, 2}, {1, 2}, {0, 1}};
  for (int r = 0; r < 5; ++r) {
    const NodePlace node = (*group)[size_t(r)]->node();
    EXPECT_EQ(std::make_pair(node.local_rank, node.local_size), expected[size_t(r)]) << r;
  }
  for (const auto& comm : Group(3)) {
    EXPECT_EQ(comm->node().local_rank, comm->rank());
    EXPECT_EQ(comm->node().local_size, 3);
  }
  EXPECT_EQ(CreateLocalCommunicators({.size = 2, .ranks_per_node = -1}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateSingleRankCommunicator()->node().local_size, 1);
}

}  // namespace
}  // namespace strata::offload

namespace strata::offload::internal {
namespace {

// A timed-out collective's error names who it waited for: the other rank, or every other one.
TEST(CollectivePeersTest, NamesTheRanksACollectiveWaitedFor) {
  EXPECT_EQ(PeersOf(0, 2), "rank 1, the other rank,");
  EXPECT_EQ(PeersOf(1, 2), "rank 0, the other rank,");
  EXPECT_EQ(PeersOf(1, 4), "one of ranks 0, 2, 3");
}

}  // namespace
}  // namespace strata::offload::internal
