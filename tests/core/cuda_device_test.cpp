// CudaDevice on a real GPU. Carries the CTest label `gpu`; skips with the reason elsewhere.
#include "strata/core/cuda_device.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "strata/core/staging_pool.h"
#include "support/gpu.h"

namespace strata {
namespace {

std::unique_ptr<Device> MakeDeviceOrSkip() {
  auto device = CreateCudaDevice({.memory_budget_bytes = 256 << 20});
  if (!device.ok()) return nullptr;
  return std::move(device).value();
}

#define SKIP_WITHOUT_GPU(device) \
  if (!(device)) STRATA_SKIP_WITHOUT_GPU(CreateCudaDevice().status().message())

TEST(CudaDeviceTest, ListsDevicesOrExplainsWhyNot) {
  auto devices = ListCudaDevices();
  if (!devices.ok()) {
    EXPECT_EQ(devices.status().code(), StatusCode::kUnavailable);
    EXPECT_FALSE(devices.status().message().empty());
    STRATA_SKIP_WITHOUT_GPU(devices.status().message());
  }
  ASSERT_FALSE(devices->empty());
  EXPECT_FALSE(devices->front().properties.name.empty());
  EXPECT_GT(devices->front().properties.total_memory_bytes, 0u);
}

TEST(CudaDeviceTest, PinnedRoundTripThroughStreamsAndEvents) {
  auto device = MakeDeviceOrSkip();
  SKIP_WITHOUT_GPU(device);
  auto pool =
      StagingPool::Create({.buffer_bytes = 16 << 20, .buffer_count = 2, .pin_with = device.get()});
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_TRUE((*pool)->pinned());
  StagingBuffer up = (*pool)->Acquire();
  StagingBuffer down = (*pool)->Acquire();
  auto* src = reinterpret_cast<float*>(up.data());
  auto* dst = reinterpret_cast<float*>(down.data());
  const size_t n = up.size() / sizeof(float);
  std::iota(src, src + n, 0.0f);
  std::fill(dst, dst + n, -1.0f);
  auto buffer = device->Allocate(up.size());
  ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
  ASSERT_TRUE(device->CopyToDevice(buffer->data(), src, up.size()).ok());
  auto event = device->CreateEvent();
  ASSERT_TRUE(device->RecordEvent(*event, Stream::kHostToDevice).ok());
  ASSERT_TRUE(device->StreamWaitEvent(Stream::kDeviceToHost, *event).ok());
  ASSERT_TRUE(device->CopyToHost(dst, buffer->data(), up.size()).ok());
  bool callback_ran = false;
  ASSERT_TRUE(device->LaunchHostFunction(Stream::kDeviceToHost, [&] { callback_ran = true; }).ok());
  ASSERT_TRUE(device->SynchronizeStream(Stream::kDeviceToHost).ok());
  EXPECT_TRUE(callback_ran);
  EXPECT_TRUE(std::equal(src, src + n, dst));
}

TEST(CudaDeviceTest, BudgetEnforced) {
  auto device = MakeDeviceOrSkip();
  SKIP_WITHOUT_GPU(device);
  auto a = device->Allocate(200 << 20);
  ASSERT_TRUE(a.ok());
  auto b = device->Allocate(100 << 20);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
}

// The engine sizes its budget from free_bytes: on a GPU far larger than the budget it must be
// the budget left, not what cudaMemGetInfo reports.
TEST(CudaDeviceTest, FreeBytesIsWhatTheBudgetStillAllows) {
  auto device = MakeDeviceOrSkip();
  SKIP_WITHOUT_GPU(device);
  EXPECT_LE(device->memory_info().free_bytes, uint64_t(256) << 20);
  auto a = device->Allocate(200 << 20);
  ASSERT_TRUE(a.ok());
  const DeviceMemoryInfo info = device->memory_info();
  EXPECT_EQ(info.budget_bytes, uint64_t(256) << 20);
  EXPECT_LE(info.free_bytes, info.budget_bytes - info.used_bytes);
}

}  // namespace
}  // namespace strata
