// What every Communicator must do, checked from one rank's side: each function runs on every
// rank of a group (threads of one process for local communicators, processes under mpirun for
// MPI ones), the same calls in the same order, and checks that rank's results. Small integers
// are exact in every dtype, so every rank can check the exact result. Group and OnEveryRank run
// such a function (or a part's test that needs several ranks) on local ranks.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/offload/communicator.h"
#include "strata/offload/local_communicator.h"

namespace strata::offload::testing {

/// `size` local ranks (threads of this process), rank r at index r; empty, with a test failure,
/// if they cannot be made.
inline std::vector<std::unique_ptr<Communicator>> Group(int size, double timeout_seconds = 60.0) {
  auto created = CreateLocalCommunicators({.size = size, .timeout_seconds = timeout_seconds});
  EXPECT_TRUE(created.ok()) << created.status().ToString();
  return created.ok() ? std::move(*created) : std::vector<std::unique_ptr<Communicator>>{};
}

/// Runs `body(communicator)` for every rank, each on a thread of its own, and waits for all.
inline void OnEveryRank(const std::vector<std::unique_ptr<Communicator>>& group,
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

inline void ExpectAllReduceSumsAndMaxesInEveryDtype(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
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
}

inline void ExpectReduceScatterLeavesEachRankItsShardOfTheSum(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  constexpr size_t kShard = 513;  // Not a multiple of anything.
  std::vector<float> send(kShard * size_t(n)), recv(kShard, -1.0f);
  for (size_t j = 0; j < send.size(); ++j) send[j] = float(100 * r) + float(j);
  ASSERT_TRUE(RunOne([&](CollectiveDone done) {
                comm.ReduceScatter(send.data(), recv.data(), kShard, DType::kFp32, ReduceOp::kSum,
                                   {}, std::move(done));
              }).ok());
  for (size_t i = 0; i < kShard; ++i) {
    const size_t j = size_t(r) * kShard + i;
    ASSERT_EQ(recv[i], float(100 * n * (n - 1) / 2) + float(n) * float(j)) << i;
  }
}

/// Out of place, and in place (each rank's shard already where the result puts it), which is
/// how a sharded engine gathers the parameters its ranks updated.
inline void ExpectAllGatherPutsEveryRanksShardInRankOrder(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  constexpr size_t kShard = 300;
  for (bool in_place : {false, true}) {
    std::vector<uint16_t> send(kShard), recv(kShard * size_t(n), 0);
    uint16_t* mine = in_place ? recv.data() + size_t(r) * kShard : send.data();
    for (size_t i = 0; i < kShard; ++i) mine[i] = Fp32ToBf16(float(r * 1000 + int(i)));
    ASSERT_TRUE(RunOne([&](CollectiveDone done) {
                  comm.AllGather(mine, recv.data(), kShard, DType::kBf16, {}, std::move(done));
                }).ok());
    for (int from = 0; from < n; ++from) {
      for (size_t i = 0; i < kShard; ++i) {
        ASSERT_EQ(recv[size_t(from) * kShard + i], Fp32ToBf16(float(from * 1000 + int(i))))
            << "in place " << in_place;
      }
    }
  }
}

/// Rank r's block b goes to rank b as its block r, bit for bit (quantized gradients travel as
/// raw words: a NaN pattern included).
inline void ExpectAllToAllSendsEachRankItsBlockOfEveryRank(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  constexpr size_t kBlock = 257;
  auto word = [](int from, int to, size_t i) {
    return uint32_t(from) << 24 | uint32_t(to) << 16 | uint32_t(i);
  };
  std::vector<uint32_t> send(kBlock * size_t(n)), recv(kBlock * size_t(n), 0);
  for (int to = 0; to < n; ++to) {
    for (size_t i = 0; i < kBlock; ++i) send[size_t(to) * kBlock + i] = word(r, to, i);
  }
  send[0] = 0x7FC00001u;  // A quiet NaN with a payload, to rank 0 from every rank.
  ASSERT_TRUE(RunOne([&](CollectiveDone done) {
                comm.AllToAll(send.data(), recv.data(), kBlock, DType::kFp32, {}, std::move(done));
              }).ok());
  for (int from = 0; from < n; ++from) {
    for (size_t i = 0; i < kBlock; ++i) {
      const uint32_t expected = r == 0 && i == 0 ? 0x7FC00001u : word(from, r, i);
      ASSERT_EQ(recv[size_t(from) * kBlock + i], expected) << "from " << from << " element " << i;
    }
  }
}

/// The enqueueing call returns at once; collectives run in the order enqueued, each once its
/// input is ready, and report in that order.
inline void ExpectCollectivesRunInOrderEachAfterItsInputIsReady(Communicator& comm) {
  const int n = comm.size();
  constexpr int kCollectives = 64;
  std::vector<std::vector<double>> values(kCollectives, std::vector<double>(3, 0.0));
  std::mutex mutex;
  std::vector<int> finished;
  std::promise<void> all_done;
  std::atomic<bool> inputs_released{false};
  for (int k = 0; k < kCollectives; ++k) {
    // The input is "produced" only once the trainer says so, after everything is enqueued: a
    // collective must not start before its ready function returns.
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
}

}  // namespace strata::offload::testing
