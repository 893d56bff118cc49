// Device: the small interface every accelerator backend implements.
//
// It has what the engine needs and no more: budgeted device memory, three in-order streams
// (compute, host-to-device, device-to-host), async copies, events, host functions queued in
// stream order, and pinning of host memory. HostDevice implements it on plain host memory and
// threads so the whole engine runs and is tested without a GPU; CudaDevice implements it on the
// CUDA runtime. Nothing here mentions CUDA types.
//
// Thread safety: every method of a Device may be called from any thread. Work queued on one
// stream runs in queue order; work on different streams is unordered unless an event orders it.
// Lifetime: a Device must outlive every handle (buffer, event, pinned region) it gave out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

class Device;

/// The three streams of a device. Copies default to the stream of their direction.
enum class Stream : int {
  kCompute = 0,       ///< Forward/backward work (and the device's share of optimizer steps).
  kHostToDevice = 1,  ///< Uploads: parameters, optimizer results.
  kDeviceToHost = 2,  ///< Downloads: gradients, evicted state.
};
inline constexpr int kStreamCount = 3;

/// "compute", "h2d" or "d2h".
std::string_view StreamName(Stream stream);

enum class DeviceKind : int { kHost = 0, kCuda = 1 };

/// "host" or "cuda".
std::string_view DeviceKindName(DeviceKind kind);

/// Static facts about a device, for logs and `strata info`.
struct DeviceProperties {
  DeviceKind kind = DeviceKind::kHost;
  std::string name;                 ///< e.g. "NVIDIA H200" or "HostDevice (2.0GiB, 16GB/s copies)".
  uint64_t total_memory_bytes = 0;  ///< Physical memory of the device (host: the budget).
  std::string pci_bus_id;           ///< "0000:1b:00.0" on CUDA; empty on the host device.
  int pcie_generation = 0;          ///< Current PCIe link generation, 0 when unknown.
  int pcie_width = 0;               ///< Current PCIe link width (lanes), 0 when unknown.
  /// The CPU may read and write this device's memory in place, and the device's work is what
  /// the CPU does (a HostDevice standing for CPU tensors, not for a GPU): the engine then reads
  /// gradients and writes new parameters where they are instead of copying them.
  bool host_accessible = false;
};

/// Memory use against the budget this Device was created with.
struct DeviceMemoryInfo {
  uint64_t budget_bytes = 0;  ///< What Allocate may hand out in total.
  uint64_t used_bytes = 0;    ///< Currently allocated through this Device.
  uint64_t peak_bytes = 0;    ///< High-water mark of used_bytes since creation.
  /// What Allocate can still hand out: budget - used, or less when the hardware has less free.
  /// The engine sizes its device budget from this.
  uint64_t free_bytes = 0;
};

namespace internal {

enum class HandleKind : int { kMemory, kEvent, kPinnedRegion };

/// Move-only owner of one device resource; returns it to its Device on destruction.
class DeviceHandle {
 public:
  DeviceHandle() = default;
  DeviceHandle(Device* device, HandleKind kind, void* pointer, size_t bytes)
      : device_(device), kind_(kind), pointer_(pointer), bytes_(bytes) {}
  ~DeviceHandle() { Reset(); }
  DeviceHandle(DeviceHandle&& other) noexcept { *this = std::move(other); }
  DeviceHandle& operator=(DeviceHandle&& other) noexcept;
  DeviceHandle(const DeviceHandle&) = delete;
  DeviceHandle& operator=(const DeviceHandle&) = delete;

  /// Returns the resource to its device now. Idempotent.
  void Reset() noexcept;

  bool valid() const { return device_ != nullptr; }
  void* pointer() const { return pointer_; }
  size_t bytes() const { return bytes_; }
  Device* device() const { return device_; }

 private:
  Device* device_ = nullptr;
  HandleKind kind_ = HandleKind::kMemory;
  void* pointer_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace internal

/// Device memory: `size()` bytes (as asked for) at `data()`, a device address (on HostDevice, host
/// memory that only streams of that device should touch). Freed when the handle dies, without
/// waiting for queued work: synchronize first if a stream may still use it.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  void* data() const { return handle_.pointer(); }
  size_t size() const { return handle_.bytes(); }
  bool valid() const { return handle_.valid(); }

 private:
  friend class Device;
  explicit DeviceBuffer(internal::DeviceHandle handle) : handle_(std::move(handle)) {}
  internal::DeviceHandle handle_;
};

/// A marker in a stream, as cudaEvent_t: recorded on a stream, it completes when all work queued
/// on that stream before the record has run. Re-recording moves the marker.
class DeviceEvent {
 public:
  DeviceEvent() = default;
  bool valid() const { return handle_.valid(); }

 private:
  friend class Device;
  explicit DeviceEvent(internal::DeviceHandle handle) : handle_(std::move(handle)) {}
  internal::DeviceHandle handle_;
};

/// Host memory registered with the device for DMA; unregistered when the handle dies. The memory
/// itself is not owned and must outlive the handle.
class PinnedHostRegion {
 public:
  PinnedHostRegion() = default;
  void* data() const { return handle_.pointer(); }
  size_t size() const { return handle_.bytes(); }
  bool valid() const { return handle_.valid(); }

 private:
  friend class Device;
  explicit PinnedHostRegion(internal::DeviceHandle handle) : handle_(std::move(handle)) {}
  internal::DeviceHandle handle_;
};

/// A function queued on a stream. On CUDA it runs on a driver thread and must not call CUDA;
/// on HostDevice it runs on the stream's worker thread and is how host "kernels" execute.
using HostFunction = std::function<void()>;

class Device {
 public:
  virtual ~Device() = default;

  virtual const DeviceProperties& properties() const = 0;
  virtual DeviceMemoryInfo memory_info() const = 0;

  /// Allocates device memory within the budget; ResourceExhausted (with the budget, the amount
  /// in use and the amount asked) when it would not fit.
  virtual Result<DeviceBuffer> Allocate(size_t bytes) = 0;

  /// Queues a copy of `bytes` from host memory to device memory on `stream`. The host memory must
  /// stay valid and unchanged until the copy has run (wait on an event or a host function).
  virtual Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes,
                              Stream stream = Stream::kHostToDevice) = 0;
  /// Queues a copy from device memory to host memory on `stream`.
  virtual Status CopyToHost(void* host_dst, const void* device_src, size_t bytes,
                            Stream stream = Stream::kDeviceToHost) = 0;

  /// Queues `function` on `stream`; it runs after all work queued there before it.
  virtual Status LaunchHostFunction(Stream stream, HostFunction function) = 0;

  virtual Result<DeviceEvent> CreateEvent() = 0;
  /// Records `event` on `stream` (moves its marker to the current end of the stream).
  virtual Status RecordEvent(DeviceEvent& event, Stream stream) = 0;
  /// Records `event` at the current end of a stream this device did not create but that runs
  /// on it: an outside trainer's (a cudaStream_t on CUDA, HostStream::native() on HostDevice).
  /// The device's own streams can then wait for work queued there. Unavailable where the
  /// device cannot.
  virtual Status RecordEventOnNativeStream(DeviceEvent& /*event*/, void* /*native_stream*/) {
    return Unavailable("this device cannot order its streams after an outside stream");
  }
  /// Makes later work on `stream` wait until `event` (as last recorded) has completed. Does not
  /// block the caller. An event never recorded is already complete.
  virtual Status StreamWaitEvent(Stream stream, const DeviceEvent& event) = 0;
  /// Blocks the caller until `event` (as last recorded) has completed.
  virtual Status SynchronizeEvent(const DeviceEvent& event) = 0;
  /// True when `event` (as last recorded) has completed.
  virtual Result<bool> QueryEvent(const DeviceEvent& event) = 0;
  /// Blocks until all work queued on `stream` has run.
  virtual Status SynchronizeStream(Stream stream) = 0;
  /// Blocks until all work on all streams has run.
  Status Synchronize();

  /// Whether PinHostMemory does anything useful (false: copies from pageable memory work, but
  /// slower on real hardware).
  virtual bool CanPin() const = 0;
  /// Registers `bytes` at `host` for fast DMA. Regions must not overlap.
  virtual Result<PinnedHostRegion> PinHostMemory(void* host, size_t bytes) = 0;

  /// The backend's native stream handle (cudaStream_t on CUDA), for code that launches backend
  /// kernels; nullptr on HostDevice.
  virtual void* NativeStream(Stream /*stream*/) const { return nullptr; }

 protected:
  friend class internal::DeviceHandle;
  /// Returns a resource handed out earlier. Called by handle destructors; must not fail.
  virtual void Release(internal::HandleKind kind, void* pointer, size_t bytes) noexcept = 0;

  // Wrapping and unwrapping handles, for implementations.
  DeviceBuffer MakeBuffer(void* pointer, size_t bytes) {
    return DeviceBuffer({this, internal::HandleKind::kMemory, pointer, bytes});
  }
  DeviceEvent MakeEvent(void* native) {
    return DeviceEvent({this, internal::HandleKind::kEvent, native, 0});
  }
  PinnedHostRegion MakePinnedRegion(void* pointer, size_t bytes) {
    return PinnedHostRegion({this, internal::HandleKind::kPinnedRegion, pointer, bytes});
  }
  /// The native pointer of an event, checked to belong to this device.
  Result<void*> NativeEvent(const DeviceEvent& event) const;
};

}  // namespace strata
