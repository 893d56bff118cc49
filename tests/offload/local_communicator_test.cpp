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

#include "strata/core/dtype.h"

namespace strata::offload {
namespace {

using std::chrono::steady_clock;

std::vector<std::unique_ptr<Communicator>> Group(int size, double timeout_seconds = 60.0) {
  auto created = CreateLocalCommunicators({.size = size, .timeout_seconds = timeout_seconds});
  EXPECT_TRUE(created.ok()) << created.status().ToString();
  return created.ok() ? std::move(*created) : std::vector<std::unique_ptr<Communicator>>{};
}

/// Runs `body(communicator)` for every rank, each on a thread of its own, and waits for all.
void OnEveryRank(const std::vector<std::unique_ptr<Communicator>>& group,
                 const std::function<void(Communicator&)>& body) {
  std::vector<std::thread> threads;
  for (const auto& comm : group) threads.emplace_back([&body, &comm] { body(*comm); });
  for (std::thread& thread : threads) thread.join();
}

/// Enqueues through `enqueue` (given the done callback) and waits for the result.
template <typename Enqueue>
Status RunOne(Enqueue enqueue) {
  std::promise<Status> finished;
  auto result = finished.get_future();
  enqueue([&finished](Status s) { finished.set_value(std::move(s)); });
  return result.get();
}

// Small integers are exact in every dtype, so every rank can check the exact result.
TEST(LocalCommunicatorTest, AllReduceSumsAndMaxesInEveryDtype) {
  constexpr int n = 3;
  auto group = Group(n);
  ASSERT_EQ(group.size(), size_t(n));
  OnEveryRank(group, [&](Communicator& comm) {
    const int r = comm.rank();
    EXPECT_EQ(comm.size(), n);
    constexpr size_t kCount = 1000;
    for (DType dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
        std::vector<float> values(kCount);
        for (size_t i = 0; i < kCount; ++i) values[i] = float(r + int(i % 7));
        std::vector<std::byte> data(kCount * DTypeSize(dtype));
        Fp32ToDType(values, dtype, data.data());
        ASSERT_TRUE(RunOne([&](CollectiveDone done) {
                      comm.AllReduce(data.data(), kCount, dtype, op, {}, std::move(done));
                    }).ok());
        DTypeToFp32(data.data(), dtype, values);
        for (size_t i = 0; i < kCount; ++i) {
          const float expected = op == ReduceOp::kSum ? float(n * (n - 1) / 2 + n * int(i % 7))
                                                      : float(n - 1 + int(i % 7));
          ASSERT_EQ(values[i], expected) << DTypeName(dtype) << " element " << i;
        }
      }
    }
  });
}

TEST(LocalCommunicatorTest, ReduceScatterLeavesEachRankItsShardOfTheSum) {
  constexpr int n = 3;
  auto group = Group(n);
  OnEveryRank(group, [&](Communicator& comm) {
    const int r = comm.rank();
    constexpr size_t kShard = 513;
    std::vector<float> send(kShard * n), recv(kShard, -1.0f);
    for (size_t j = 0; j < send.size(); ++j) send[j] = float(100 * r) + float(j);
    ASSERT_TRUE(RunOne([&](CollectiveDone done) {
                  comm.ReduceScatter(send.data(), recv.data(), kShard, DType::kFp32, ReduceOp::kSum,
                                     {}, std::move(done));
                }).ok());
    for (size_t i = 0; i < kShard; ++i) {
      const size_t j = size_t(r) * kShard + i;
      ASSERT_EQ(recv[i], float(100 * n * (n - 1) / 2) + float(n) * float(j)) << i;
    }
  });
}

// Out of place, and in place (each rank's shard already where the result puts it), which is
// how a sharded engine gathers the parameters its ranks updated.
TEST(LocalCommunicatorTest, AllGatherPutsEveryRanksShardInRankOrder) {
  constexpr int n = 4;
  constexpr size_t kShard = 300;
  auto group = Group(n);
  OnEveryRank(group, [&](Communicator& comm) {
    const int r = comm.rank();
    for (bool in_place : {false, true}) {
      std::vector<uint16_t> send(kShard), recv(kShard * n, 0);
      uint16_t* mine = in_place ? recv.data() + size_t(r) * kShard : send.data();
      for (size_t i = 0; i < kShard; ++i) mine[i] = Fp32ToBf16(float(r * 1000 + int(i)));
      ASSERT_TRUE(RunOne([&](CollectiveDone done) {
                    comm.AllGather(mine, recv.data(), kShard, DType::kBf16, {}, std::move(done));
                  }).ok());
      for (int from = 0; from < n; ++from) {
        for (size_t i = 0; i < kShard; ++i) {
          ASSERT_EQ(recv[from * kShard + i], Fp32ToBf16(float(from * 1000 + int(i))))
              << "in place " << in_place;
        }
      }
    }
  });
}

// The enqueueing call returns at once; collectives run in the order enqueued, each once its
// input is ready, and report in that order.
TEST(LocalCommunicatorTest, CollectivesRunInOrderEachAfterItsInputIsReady) {
  constexpr int n = 2;
  auto group = Group(n);
  OnEveryRank(group, [&](Communicator& comm) {
    constexpr int kCollectives = 64;
    std::vector<std::vector<double>> values(kCollectives, std::vector<double>(3, 0.0));
    std::mutex mutex;
    std::vector<int> finished;
    std::promise<void> all_done;
    std::atomic<bool> inputs_released{false};
    for (int k = 0; k < kCollectives; ++k) {
      auto ready = [&, k]() -> Status {
        while (!inputs_released.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        values[k] = {1.0, double(k), double(comm.rank())};
        return Status();
      };
      comm.AllReduceScalars(values[k], k % 2 ? ReduceOp::kMax : ReduceOp::kSum, ready,
                            [&, k](Status s) {
                              EXPECT_TRUE(s.ok()) << s.ToString();
                              std::lock_guard lock(mutex);
                              finished.push_back(k);
                              if (finished.size() == kCollectives) all_done.set_value();
                            });
    }
    {
      std::lock_guard lock(mutex);
      EXPECT_TRUE(finished.empty()) << "a collective ran before its input was ready";
    }
    inputs_released = true;
    all_done.get_future().wait();
    for (int k = 0; k < kCollectives; ++k) {
      EXPECT_EQ(finished[k], k);
      if (k % 2) {
        EXPECT_EQ(values[k], (std::vector<double>{1.0, double(k), double(n - 1)}));
      } else {
        EXPECT_EQ(values[k],
                  (std::vector<double>{double(n), double(n) * k, double(n * (n - 1) / 2)}));
      }
    }
    std::vector<double> sum = {2.5};
    ASSERT_TRUE(comm.AllReduceSum(sum).ok());
    EXPECT_EQ(sum[0], 2.5 * n);
  });
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

}  // namespace
}  // namespace strata::offload
