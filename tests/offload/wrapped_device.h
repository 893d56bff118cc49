// WrappedDevice: a Device that forwards to another and can lie about itself or fail on purpose,
// so engine tests reach the paths a real GPU or a broken link would take. Buffers, events and
// pinned regions all come from (and go back to) the inner device.
#pragma once

#include <atomic>
#include <optional>

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
  /// Refuses the `skip`+1-th CopyToDevice from now on, and the `times`-1 after it.
  void FailCopiesToDevice(int skip, int times = 1) {
    copies_to_skip_ = skip;
    copies_to_fail_ = times;
  }
  int failed_copies() const { return failed_copies_; }

  const DeviceProperties& properties() const override { return properties_; }
  DeviceMemoryInfo memory_info() const override {
    DeviceMemoryInfo info = inner_.memory_info();
    if (hardware_free_) info.free_bytes = *hardware_free_;
    return info;
  }
  Result<DeviceBuffer> Allocate(size_t bytes) override { return inner_.Allocate(bytes); }
  Status CopyToDevice(void* dst, const void* src, size_t bytes, Stream stream) override {
    if (copies_to_fail_ > 0 && copies_to_skip_-- <= 0) {
      --copies_to_fail_;
      ++failed_copies_;
      return IoError("wrapped device: injected failure of a host-to-device copy");
    }
    return inner_.CopyToDevice(dst, src, bytes, stream);
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes, Stream stream) override {
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
  Device& inner_;
  DeviceProperties properties_;
  std::optional<uint64_t> hardware_free_;
  std::atomic<int> copies_to_skip_{0};
  std::atomic<int> copies_to_fail_{0};
  std::atomic<int> failed_copies_{0};
};

}  // namespace strata::offload::testing
