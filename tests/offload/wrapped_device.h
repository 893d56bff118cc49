// WrappedDevice: a Device that forwards to another and can lie about itself or fail on purpose,
// so engine tests reach the paths a real GPU or a broken link would take. Buffers, events and
// pinned regions all come from (and go back to) the inner device.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "strata/core/device.h"

namespace strata::offload::testing {

class WrappedDevice final : public Device {
 public:
  explicit WrappedDevice(Device& inner) : inner_(inner), properties_(inner.properties()) {}

  /// Reports `kind` in properties() (the memory and streams stay the inner device's).
  void ReportKind(DeviceKind kind) { properties_.kind = kind; }
  /// Reports `bytes` as the hardware's free memory in memory_info(), as cudaMemGetInfo would
  /// on a GPU much larger than the device's budget.
  void ReportHardwareFree(uint64_t bytes) { hardware_free_ = bytes; }
  /// Refuses the `skip`+1-th CopyToDevice of the engine from now on, and the `times`-1 after
  /// it. The engine's copies are those on its copy streams: a trainer's own copies on
  /// Stream::kCompute (gradients written on a GPU) neither fail nor count.
  void FailCopiesToDevice(int skip, int times = 1) {
    copies_to_skip_ = skip;
    copies_to_fail_ = times;
  }
  int failed_copies() const { return failed_copies_; }
  /// From now on, each CopyToDevice of the engine waits `delay` on its stream before it copies
  /// (a slow link).
  void DelayCopiesToDevice(std::chrono::milliseconds delay) { copy_delay_ = delay; }
  /// From now on, checks that every copy stays inside the device allocation it touches, by the
  /// size that was asked for (HostDevice rounds allocations up to pages, a GPU does not); a copy
  /// that leaves it fails and is counted.
  void CheckCopyBounds() { check_bounds_ = true; }
  int copies_out_of_bounds() const { return out_of_bounds_; }
  /// Successful Allocate calls so far.
  int allocations() const { return allocation_count_; }

  const DeviceProperties& properties() const override { return properties_; }
  DeviceMemoryInfo memory_info() const override {
    DeviceMemoryInfo info = inner_.memory_info();
    if (hardware_free_) info.free_bytes = *hardware_free_;
    return info;
  }
  Result<DeviceBuffer> Allocate(size_t bytes) override {
    Result<DeviceBuffer> buffer = inner_.Allocate(bytes);
    if (buffer.ok()) {
      ++allocation_count_;
      std::lock_guard lock(mutex_);
      allocations_[reinterpret_cast<uintptr_t>(buffer->data())] = bytes;
    }
    return buffer;
  }
  Status CopyToDevice(void* dst, const void* src, size_t bytes, Stream stream) override {
    STRATA_RETURN_IF_ERROR(CheckBounds(dst, bytes, "to"));
    if (stream == Stream::kCompute) return inner_.CopyToDevice(dst, src, bytes, stream);
    if (copies_to_fail_ > 0 && copies_to_skip_-- <= 0) {
      --copies_to_fail_;
      ++failed_copies_;
      return IoError("wrapped device: injected failure of a host-to-device copy");
    }
    if (const std::chrono::milliseconds delay = copy_delay_.load(); delay.count() > 0) {
      STRATA_RETURN_IF_ERROR(
          inner_.LaunchHostFunction(stream, [delay] { std::this_thread::sleep_for(delay); }));
    }
    return inner_.CopyToDevice(dst, src, bytes, stream);
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes, Stream stream) override {
    STRATA_RETURN_IF_ERROR(CheckBounds(src, bytes, "from"));
    return inner_.CopyToHost(dst, src, bytes, stream);
  }
  Status LaunchHostFunction(Stream stream, HostFunction function) override {
    return inner_.LaunchHostFunction(stream, std::move(function));
  }
  Result<DeviceEvent> CreateEvent() override { return inner_.CreateEvent(); }
  Status RecordEvent(DeviceEvent& event, Stream stream) override {
    return inner_.RecordEvent(event, stream);
  }
  Status RecordEventOnNativeStream(DeviceEvent& event, void* native_stream) override {
    return inner_.RecordEventOnNativeStream(event, native_stream);
  }
  Status StreamWaitEvent(Stream stream, const DeviceEvent& event) override {
    return inner_.StreamWaitEvent(stream, event);
  }
  Status SynchronizeEvent(const DeviceEvent& event) override {
    return inner_.SynchronizeEvent(event);
  }
  Result<bool> QueryEvent(const DeviceEvent& event) override { return inner_.QueryEvent(event); }
  Status SynchronizeStream(Stream stream) override { return inner_.SynchronizeStream(stream); }
  bool CanPin() const override { return inner_.CanPin(); }
  Result<PinnedHostRegion> PinHostMemory(void* host, size_t bytes) override {
    return inner_.PinHostMemory(host, bytes);
  }

 protected:
  // Every handle names the inner device, which takes it back.
  void Release(internal::HandleKind, void*, size_t) noexcept override {}

 private:
  // The allocation that holds `device` (the latest one at or below it) must hold all `bytes`.
  Status CheckBounds(const void* device, size_t bytes, const char* direction) {
    if (!check_bounds_) return Status();
    const auto address = reinterpret_cast<uintptr_t>(device);
    std::lock_guard lock(mutex_);
    auto it = allocations_.upper_bound(address);
    if (it != allocations_.begin() &&
        address + bytes <= std::prev(it)->first + std::prev(it)->second) {
      return Status();
    }
    ++out_of_bounds_;
    return Internal(std::string("wrapped device: a copy ") + direction + " the device of " +
                    std::to_string(bytes) + " bytes leaves its allocation");
  }

  Device& inner_;
  DeviceProperties properties_;
  std::optional<uint64_t> hardware_free_;
  std::atomic<int> copies_to_skip_{0};
  std::atomic<int> copies_to_fail_{0};
  std::atomic<int> failed_copies_{0};
  std::atomic<bool> check_bounds_{false};
  std::atomic<std::chrono::milliseconds> copy_delay_{std::chrono::milliseconds(0)};
  std::atomic<int> out_of_bounds_{0};
  std::atomic<int> allocation_count_{0};
  std::mutex mutex_;
  std::map<uintptr_t, size_t> allocations_;  // Start -> bytes asked for, of every allocation.
};

}  // namespace strata::offload::testing
