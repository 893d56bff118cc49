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

#include "strata/core/dtype.h"
#include "strata/offload/ranks.h"

namespace strata::offload {
namespace {

std::unique_ptr<Communicator> Create(double timeout_seconds = 60.0) {
  auto created = CreateMpiCommunicator({.timeout_seconds = timeout_seconds});
  EXPECT_TRUE(created.ok()) << created.status().ToString();
  return created.ok() ? std::move(*created) : nullptr;
}

/// Enqueues through `enqueue` (given the done callback) and waits for the result.
template <typename Enqueue>
Status RunOne(Enqueue enqueue) {
  std::promise<Status> finished;
  auto result = finished.get_future();
  enqueue([&finished](Status s) { finished.set_value(std::move(s)); });
  return result.get();
}

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

// Small integers are exact in every dtype, so every rank can check the exact result.
TEST(MpiCommunicatorTest, AllReduceSumsAndMaxesInEveryDtype) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  const int n = comm->size(), r = comm->rank();
  constexpr size_t kCount = 1000;
  for (DType dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      std::vector<float> values(kCount);
      for (size_t i = 0; i < kCount; ++i) values[i] = float(r + int(i % 7));
      std::vector<std::byte> data(kCount * DTypeSize(dtype));
      Fp32ToDType(values, dtype, data.data());
      ASSERT_TRUE(RunOne([&](CollectiveDone done) {
                    comm->AllReduce(data.data(), kCount, dtype, op, {}, std::move(done));
                  }).ok());
      DTypeToFp32(data.data(), dtype, values);
      for (size_t i = 0; i < kCount; ++i) {
        const float expected = op == ReduceOp::kSum ? float(n * (n - 1) / 2 + n * int(i % 7))
                                                    : float(n - 1 + int(i % 7));
        ASSERT_EQ(values[i], expected) << DTypeName(dtype) << " element " << i;
      }
    }
  }
}

TEST(MpiCommunicatorTest, ReduceScatterLeavesEachRankItsShardOfTheSum) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  const int n = comm->size(), r = comm->rank();
  constexpr size_t kShard = 513;  // Not a multiple of anything.
  std::vector<float> send(kShard * n), recv(kShard, -1.0f);
  for (size_t j = 0; j < send.size(); ++j) send[j] = float(100 * r) + float(j);
  ASSERT_TRUE(RunOne([&](CollectiveDone done) {
                comm->ReduceScatter(send.data(), recv.data(), kShard, DType::kFp32, ReduceOp::kSum,
                                    {}, std::move(done));
              }).ok());
  for (size_t i = 0; i < kShard; ++i) {
    const size_t j = size_t(r) * kShard + i;
    ASSERT_EQ(recv[i], float(100 * n * (n - 1) / 2) + float(n) * float(j)) << i;
  }
}

// Out of place, and in place (each rank's shard already where the result puts it), which is
// how a sharded engine gathers the parameters its ranks updated.
TEST(MpiCommunicatorTest, AllGatherPutsEveryRanksShardInRankOrder) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  const int n = comm->size(), r = comm->rank();
  constexpr size_t kShard = 300;
  for (bool in_place : {false, true}) {
    std::vector<uint16_t> send(kShard), recv(kShard * n, 0);
    uint16_t* mine = in_place ? recv.data() + size_t(r) * kShard : send.data();
    for (size_t i = 0; i < kShard; ++i) mine[i] = Fp32ToBf16(float(r * 1000 + int(i)));
    ASSERT_TRUE(RunOne([&](CollectiveDone done) {
                  comm->AllGather(mine, recv.data(), kShard, DType::kBf16, {}, std::move(done));
                }).ok());
    for (int from = 0; from < n; ++from) {
      for (size_t i = 0; i < kShard; ++i) {
        ASSERT_EQ(recv[from * kShard + i], Fp32ToBf16(float(from * 1000 + int(i))))
            << "in place " << in_place;
      }
    }
  }
}

// The enqueueing call returns at once; collectives run in the order enqueued, each once its
// input is ready, and report in that order.
TEST(MpiCommunicatorTest, CollectivesRunInOrderEachAfterItsInputIsReady) {
  auto comm = Create();
  ASSERT_NE(comm, nullptr);
  const int n = comm->size();
  constexpr int kCollectives = 64;
  std::vector<std::vector<double>> values(kCollectives, std::vector<double>(3, 0.0));
  std::mutex mutex;
  std::vector<int> finished;
  std::promise<void> all_done;
  std::atomic<bool> inputs_released{false};
  for (int k = 0; k < kCollectives; ++k) {
    // The input is "produced" only once the trainer says so, after everything is enqueued:
    // a collective must not start before its ready function returns.
    auto ready = [&, k]() -> Status {
      while (!inputs_released.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      values[k] = {1.0, double(k), double(comm->rank())};
      return Status();
    };
    comm->AllReduceScalars(values[k], k % 2 ? ReduceOp::kMax : ReduceOp::kSum, ready,
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
  ASSERT_TRUE(comm->AllReduceSum(sum).ok());
  EXPECT_EQ(sum[0], 2.5 * n);
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
