#include "strata/core/host_device.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <numeric>
#include <vector>

namespace strata {
namespace {

std::unique_ptr<Device> MakeDevice(HostDeviceOptions options = {}) {
  auto device = CreateHostDevice(options);
  EXPECT_TRUE(device.ok()) << device.status().ToString();
  return std::move(device).value();
}

TEST(HostDeviceTest, BudgetEnforcedAndReturned) {
  auto device = MakeDevice({.memory_budget_bytes = 1 << 20});
  auto a = device->Allocate(600 << 10);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(device->memory_info().used_bytes, 600u << 10);
  auto small = device->Allocate(10);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->size(), 10u) << "a buffer reports the size asked for";
  EXPECT_EQ(device->memory_info().used_bytes, (600u << 10) + 4096) << "budget counts pages";
  *small = DeviceBuffer();
  auto b = device->Allocate(600 << 10);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("budget of 1MiB"), std::string::npos) << b.status().message();
  *a = DeviceBuffer();  // Frees.
  EXPECT_EQ(device->memory_info().used_bytes, 0u);
  EXPECT_EQ(device->memory_info().peak_bytes, (600u << 10) + 4096);
  EXPECT_TRUE(device->Allocate(1 << 20).ok());
}

TEST(HostDeviceTest, CopiesRoundTrip) {
  auto device = MakeDevice();
  std::vector<float> host(1 << 16), back(1 << 16, 0.0f);
  std::iota(host.begin(), host.end(), 1.0f);
  auto buffer = device->Allocate(host.size() * sizeof(float));
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE(device->CopyToDevice(buffer->data(), host.data(), buffer->size()).ok());
  auto uploaded = device->CreateEvent();
  ASSERT_TRUE(uploaded.ok());
  ASSERT_TRUE(device->RecordEvent(*uploaded, Stream::kHostToDevice).ok());
  // The download stream must wait for the upload: an event orders the two streams.
  ASSERT_TRUE(device->StreamWaitEvent(Stream::kDeviceToHost, *uploaded).ok());
  ASSERT_TRUE(device->CopyToHost(back.data(), buffer->data(), buffer->size()).ok());
  ASSERT_TRUE(device->SynchronizeStream(Stream::kDeviceToHost).ok());
  EXPECT_EQ(host, back);
}

TEST(HostDeviceTest, StreamRunsInOrder) {
  auto device = MakeDevice();
  std::vector<int> order;
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(
        device->LaunchHostFunction(Stream::kCompute, [&order, i] { order.push_back(i); }).ok());
  }
  ASSERT_TRUE(device->SynchronizeStream(Stream::kCompute).ok());
  std::vector<int> expected(100);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
}

TEST(HostDeviceTest, EventWaitOrdersAcrossStreams) {
  auto device = MakeDevice();
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<int> step{0};
  int seen_by_compute = -1;
  // h2d: blocked until the test releases it, then sets step = 1.
  ASSERT_TRUE(device
                  ->LaunchHostFunction(Stream::kHostToDevice,
                                       [gate, &step] {
                                         gate.wait();
                                         step = 1;
                                       })
                  .ok());
  auto event = device->CreateEvent();
  ASSERT_TRUE(device->RecordEvent(*event, Stream::kHostToDevice).ok());
  ASSERT_TRUE(device->StreamWaitEvent(Stream::kCompute, *event).ok());
  ASSERT_TRUE(device->LaunchHostFunction(Stream::kCompute, [&] { seen_by_compute = step; }).ok());

  EXPECT_FALSE(*device->QueryEvent(*event));
  release.set_value();
  ASSERT_TRUE(device->SynchronizeEvent(*event).ok());
  EXPECT_TRUE(*device->QueryEvent(*event));
  ASSERT_TRUE(device->SynchronizeStream(Stream::kCompute).ok());
  EXPECT_EQ(seen_by_compute, 1);
}

TEST(HostDeviceTest, UnrecordedEventIsComplete) {
  auto device = MakeDevice();
  auto event = device->CreateEvent();
  ASSERT_TRUE(event.ok());
  EXPECT_TRUE(*device->QueryEvent(*event));
  EXPECT_TRUE(device->StreamWaitEvent(Stream::kCompute, *event).ok());
  EXPECT_TRUE(device->SynchronizeEvent(*event).ok());
}

TEST(HostDeviceTest, EventFromAnotherDeviceRejected) {
  auto a = MakeDevice();
  auto b = MakeDevice();
  auto event = a->CreateEvent();
  Status s = b->RecordEvent(*event, Stream::kCompute);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  DeviceEvent empty;
  EXPECT_EQ(a->SynchronizeEvent(empty).code(), StatusCode::kInvalidArgument);
}

TEST(HostDeviceTest, EventMayDieWhileQueued) {
  auto device = MakeDevice();
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  ASSERT_TRUE(device->LaunchHostFunction(Stream::kCompute, [gate] { gate.wait(); }).ok());
  {
    auto event = device->CreateEvent();
    ASSERT_TRUE(device->RecordEvent(*event, Stream::kCompute).ok());
  }  // Destroyed while its record is still queued.
  release.set_value();
  EXPECT_TRUE(device->SynchronizeStream(Stream::kCompute).ok());
}

TEST(HostDeviceTest, ThrottledCopyTakesBandwidthTime) {
  // 4 MiB at 100 MB/s must take at least ~42 ms; the bound is a lower bound, so it cannot be
  // made flaky by a slow machine.
  auto device = MakeDevice({.copy_bytes_per_second = 100e6});
  std::vector<char> host(4 << 20, 'x');
  auto buffer = device->Allocate(host.size());
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(device->CopyToDevice(buffer->data(), host.data(), host.size()).ok());
  ASSERT_TRUE(device->SynchronizeStream(Stream::kHostToDevice).ok());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(seconds, 0.9 * (4 << 20) / 100e6);
}

TEST(HostDeviceTest, RejectsBadArguments) {
  EXPECT_EQ(CreateHostDevice({.copy_bytes_per_second = -1}).status().code(),
            StatusCode::kInvalidArgument);
  auto device = MakeDevice();
  EXPECT_EQ(device->LaunchHostFunction(Stream::kCompute, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device->PinHostMemory(nullptr, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(HostDeviceTest, DestructionRunsQueuedWork) {
  std::atomic<int> ran{0};
  {
    auto device = MakeDevice();
    for (int i = 0; i < 50; ++i) {
      ASSERT_TRUE(device->LaunchHostFunction(Stream::kDeviceToHost, [&ran] { ++ran; }).ok());
    }
  }
  EXPECT_EQ(ran.load(), 50);
}

}  // namespace
}  // namespace strata
