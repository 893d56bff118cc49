// The NCCL communicator on a GPU (label `gpu`): one rank, since NCCL takes one rank per GPU and
// the test machine has one; its collectives are then copies, which still run every path —
// NCCL's launch, host buffers staged through device scratch, device buffers in place, the
// stream polled to completion — and the contract's ordering and failures.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "strata/offload/nccl_communicator.h"
#include "support/gpu.h"
#include "support/scratch_dir.h"

namespace strata::offload {
namespace {

/// Why these tests cannot run here ("" when they can): NCCL not built, or no GPU the runtime
/// can use (no device, or a driver older than the runtime).
std::string WhyNoNccl() {
  if (!NcclAvailable()) return "built without NCCL";
  int devices = 0;
  const cudaError_t listed = cudaGetDeviceCount(&devices);
  if (listed != cudaSuccess) return std::string("no usable GPU: ") + cudaGetErrorString(listed);
  return devices == 0 ? "no GPU" : "";
}

#define SKIP_WITHOUT_NCCL()                                        \
  if (const std::string why = WhyNoNccl(); !why.empty()) STRATA_SKIP_WITHOUT_GPU(why)

std::unique_ptr<Communicator> MakeOne() {
  auto comm = CreateNcclCommunicator({.rank = 0, .size = 1, .timeout_seconds = 30});
  EXPECT_TRUE(comm.ok()) << comm.status().ToString();
  return comm.ok() ? std::move(*comm) : nullptr;
}

Status Wait(const std::function<void(CollectiveDone)>& enqueue) {
  std::promise<Status> finished;
  std::future<Status> result = finished.get_future();
  enqueue([&finished](Status status) { finished.set_value(std::move(status)); });
  return result.get();
}

TEST(NcclCommunicatorTest, HostBuffersGoThroughTheDevice) {
  SKIP_WITHOUT_NCCL();
  auto comm = MakeOne();
  ASSERT_NE(comm, nullptr);
  EXPECT_EQ(comm->size(), 1);
  std::vector<float> data = {1, 2, 3, 4};
  ASSERT_TRUE(Wait([&](CollectiveDone done) {
                comm->AllReduce(data.data(), data.size(), DType::kFp32, ReduceOp::kSum, {},
                                std::move(done));
              }).ok());
  EXPECT_EQ(data, (std::vector<float>{1, 2, 3, 4}));
  std::vector<float> shard(4, 0.0f);
  ASSERT_TRUE(Wait([&](CollectiveDone done) {
                comm->ReduceScatter(data.data(), shard.data(), 4, DType::kFp32, ReduceOp::kSum, {},
                                    std::move(done));
              }).ok());
  EXPECT_EQ(shard, data);
  std::vector<float> gathered(4, 0.0f);
  ASSERT_TRUE(Wait([&](CollectiveDone done) {
                comm->AllGather(shard.data(), gathered.data(), 4, DType::kFp32, {},
                                std::move(done));
              }).ok());
  EXPECT_EQ(gathered, data);
  std::vector<float> exchanged(4, 0.0f);
  ASSERT_TRUE(Wait([&](CollectiveDone done) {
                comm->AllToAll(data.data(), exchanged.data(), 4, DType::kFp32, {}, std::move(done));
              }).ok());
  EXPECT_EQ(exchanged, data);
  std::vector<double> scalars = {2.5, -1.0};
  ASSERT_TRUE(comm->AllReduceNow(scalars, ReduceOp::kMax).ok());
  EXPECT_EQ(scalars, (std::vector<double>{2.5, -1.0}));
}

TEST(NcclCommunicatorTest, DeviceBuffersWorkInPlace) {
  SKIP_WITHOUT_NCCL();
  auto comm = MakeOne();
  ASSERT_NE(comm, nullptr);
  const std::vector<float> values = {5, 6, 7, 8};
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 2 * values.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(device, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice),
      cudaSuccess);
  ASSERT_TRUE(Wait([&](CollectiveDone done) {
                comm->ReduceScatter(device, device + 4, 4, DType::kFp32, ReduceOp::kSum, {},
                                    std::move(done));
              }).ok());
  ASSERT_TRUE(Wait([&](CollectiveDone done) {
                comm->AllGather(device + 4, device + 4, 4, DType::kFp32, {}, std::move(done));
              }).ok());
  std::vector<float> back(4);
  ASSERT_EQ(cudaMemcpy(back.data(), device + 4, 4 * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(back, values);
  cudaFree(device);
}

// Collectives run in the order enqueued, each after its ready function; one whose input failed
// fails, and so does every later one.
TEST(NcclCommunicatorTest, AFailedInputFailsItAndEveryLaterCollective) {
  SKIP_WITHOUT_NCCL();
  auto comm = MakeOne();
  ASSERT_NE(comm, nullptr);
  std::vector<int> order;
  std::vector<float> data = {1};
  std::promise<Status> first, second, third;
  comm->AllReduce(
      data.data(), 1, DType::kFp32, ReduceOp::kSum,
      [&] {
        order.push_back(1);
        return Status();
      },
      [&](Status s) { first.set_value(s); });
  comm->AllReduce(
      data.data(), 1, DType::kFp32, ReduceOp::kSum,
      [&] {
        order.push_back(2);
        return IoError("input lost");
      },
      [&](Status s) { second.set_value(s); });
  comm->AllReduce(data.data(), 1, DType::kFp32, ReduceOp::kSum, {},
                  [&](Status s) { third.set_value(s); });
  EXPECT_TRUE(first.get_future().get().ok());
  EXPECT_FALSE(second.get_future().get().ok());
  const Status later = third.get_future().get();
  EXPECT_FALSE(later.ok());
  EXPECT_NE(later.message().find("input lost"), std::string::npos) << later.ToString();
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

// A rank that never joins (rank 1 of 2 is never started) is an error after the timeout, not a
// hang: the communicator is made nonblocking and abandoned.
TEST(NcclCommunicatorTest, ARankThatNeverJoinsIsAnErrorAfterTheTimeout) {
  SKIP_WITHOUT_NCCL();
  strata::testing::ScratchDir dir;
  const auto start = std::chrono::steady_clock::now();
  auto comm = CreateNcclCommunicator(
      {.rank = 0, .size = 2, .id_file = dir.path() / "nccl-id", .timeout_seconds = 2});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(comm.status().code(), StatusCode::kUnavailable) << comm.status().ToString();
  EXPECT_NE(comm.status().message().find("not every rank joined"), std::string::npos)
      << comm.status().ToString();
  EXPECT_LT(seconds, 30.0);
}

TEST(NcclCommunicatorTest, BadOptionsAreRefused) {
  if (!NcclAvailable()) STRATA_SKIP_WITHOUT_GPU("built without NCCL");
  EXPECT_EQ(CreateNcclCommunicator({.rank = 2, .size = 2}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateNcclCommunicator({.rank = 0, .size = 1, .timeout_seconds = 0}).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::offload
