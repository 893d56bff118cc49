// The device an engine suite runs on. The suites parametrised over DeviceUnderTest (equivalence,
// speculation, delayed update, the trainer contract) run every assertion on a HostDevice here
// and on GPU 0 where there is one. Their CUDA instances are named Cuda/... and carry the `gpu`
// label instead of their own (label_gpu_instances.cmake), so `ctest -LE gpu` leaves them out on
// a CPU machine and `STRATA_EXPECT_GPU=1 ctest -L gpu` counts each one on a GPU.
//
// Everything here reaches device memory only through the Device interface (copies on
// Stream::kCompute, as a trainer's kernels would run), except on a HostDevice, whose memory the
// test reads and writes in place as it always did.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

#include "strata/core/aligned_buffer.h"
#include "strata/core/device.h"
#include "support/gpu.h"

namespace strata::offload::testing {

enum class DeviceUnderTest { kHost, kCuda };

/// "Host" or "Cuda": the prefix of a parametrised suite's instances.
inline std::string_view DeviceUnderTestName(DeviceUnderTest kind) {
  return kind == DeviceUnderTest::kHost ? "Host" : "Cuda";
}

/// How gtest shows it (in test names and failures).
inline void PrintTo(DeviceUnderTest kind, std::ostream* out) { *out << DeviceUnderTestName(kind); }

/// Why `kind` cannot run here (the CUDA runtime's reason, or a build without CUDA); nullopt
/// when it can. Asked once per process.
std::optional<std::string> WhyUnusable(DeviceUnderTest kind);

/// A device of `kind` with `budget` bytes: a HostDevice standing for a GPU (every copy made, no
/// zero copy), or a CudaDevice on GPU 0. Null, with a test failure saying why, when it cannot
/// be made (call WhyUnusable first).
std::unique_ptr<Device> MakeDeviceUnderTest(DeviceUnderTest kind, uint64_t budget);

/// Whether the test reaches `device`'s memory in place (a HostDevice, whose memory is the
/// host's) rather than through the device's copies (a GPU).
inline bool InPlace(const Device& device) { return device.properties().kind == DeviceKind::kHost; }

/// Copies `bytes` of device memory at `src` to host memory at `dst`, after the work queued on
/// Stream::kCompute, and waits for it. In place on a HostDevice.
Status ReadDeviceMemory(Device& device, const void* src, void* dst, size_t bytes);
/// Copies `bytes` of host memory at `src` to device memory at `dst` on Stream::kCompute, and
/// waits for it. In place on a HostDevice.
Status WriteDeviceMemory(Device& device, void* dst, const void* src, size_t bytes);

/// Host memory a device copies from or to without holding up the caller: pinned beside a GPU
/// (from pageable memory, a copy to the device first waits for its stream, and a copy from it
/// returns only once done), plain beside a HostDevice, whose memory is the host's.
class StagingBuffer {
 public:
  static Result<StagingBuffer> Create(Device& device, size_t bytes);
  std::byte* data() const { return memory_.data(); }

 private:
  StagingBuffer(AlignedBuffer memory, PinnedHostRegion pinned)
      : memory_(std::move(memory)), pinned_(std::move(pinned)) {}
  AlignedBuffer memory_;
  PinnedHostRegion pinned_;  // Declared after memory_: unpinned before it is freed.
};

/// A trainer's own stream, outside the engine's device (PyTorch's current stream): a HostStream
/// beside a HostDevice, a cudaStream_t of its own beside a CudaDevice. native() is what a
/// TrainerStream names.
class OutsideStream {
 public:
  /// The kind of outside stream `device` takes; Unavailable when this build cannot make it.
  static Result<std::unique_ptr<OutsideStream>> Create(const Device& device);
  virtual ~OutsideStream() = default;

  /// Queues a wait of `delay` (a slow kernel).
  virtual Status Sleep(std::chrono::milliseconds delay) = 0;
  /// Queues a copy of `bytes` from host memory at `src` (copied now: the caller may reuse it at
  /// once) to device memory at `dst`.
  virtual Status Write(void* dst, const void* src, size_t bytes) = 0;
  /// Blocks until everything queued so far has run.
  virtual Status Synchronize() = 0;
  virtual void* native() = 0;
};

}  // namespace strata::offload::testing

/// Ends the test (from a TEST body or SetUp) when `kind` cannot run here: a skip, or under
/// STRATA_EXPECT_GPU=1 a failure, saying why.
#define STRATA_SKIP_UNLESS_USABLE(kind)                                                    \
  if (const std::optional<std::string> why_unusable =                                     \
          ::strata::offload::testing::WhyUnusable(kind)) {                                \
    STRATA_SKIP_WITHOUT_GPU(*why_unusable);                                               \
  }
