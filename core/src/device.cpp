#include "strata/core/device.h"

namespace strata {

std::string_view StreamName(Stream stream) {
  switch (stream) {
    case Stream::kCompute: return "compute";
    case Stream::kHostToDevice: return "h2d";
    case Stream::kDeviceToHost: return "d2h";
  }
  return "unknown";
}

std::string_view DeviceKindName(DeviceKind kind) {
  return kind == DeviceKind::kCuda ? "cuda" : "host";
}

namespace internal {

DeviceHandle& DeviceHandle::operator=(DeviceHandle&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = std::exchange(other.device_, nullptr);
    kind_ = other.kind_;
    pointer_ = std::exchange(other.pointer_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceHandle::Reset() noexcept {
  if (device_ != nullptr) device_->Release(kind_, pointer_, bytes_);
  device_ = nullptr;
  pointer_ = nullptr;
  bytes_ = 0;
}

}  // namespace internal

Status Device::Synchronize() {
  for (int s = 0; s < kStreamCount; ++s) {
    STRATA_RETURN_IF_ERROR(SynchronizeStream(static_cast<Stream>(s)));
  }
  return Status();
}

Result<void*> Device::NativeEvent(const DeviceEvent& event) const {
  if (!event.handle_.valid()) return InvalidArgument("the event is empty (moved from or default)");
  if (event.handle_.device() != this) {
    return InvalidArgument("the event belongs to another device");
  }
  return event.handle_.pointer();
}

}  // namespace strata
