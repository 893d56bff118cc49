// HostDevice: the Device interface on host memory and threads, always built.
//
// "Device memory" is host memory under a budget; each stream is one in-order worker thread;
// copies may be throttled to a set bandwidth to imitate PCIe. Events and host functions keep
// CUDA's ordering rules, so every pipeline and test runs on machines without a GPU.
#pragma once

#include <cstdint>
#include <memory>

#include "strata/core/device.h"

namespace strata {

struct HostDeviceOptions {
  /// Bytes that Allocate may hand out in total; beyond it Allocate returns ResourceExhausted.
  uint64_t memory_budget_bytes = uint64_t{2} << 30;
  /// Each copy takes at least bytes / this many seconds (per stream, as PCIe is full duplex).
  /// 0 copies at memcpy speed.
  double copy_bytes_per_second = 0.0;
  /// DeviceProperties::host_accessible: the device stands for the CPU itself (PyTorch's CPU
  /// tensors), so the engine skips the copies a GPU needs. False (the default) keeps every copy,
  /// so that tests and `strata train` on a HostDevice exercise the paths a GPU takes.
  bool host_accessible = false;
};

/// Creates a HostDevice; InvalidArgument for a negative copy bandwidth.
Result<std::unique_ptr<Device>> CreateHostDevice(const HostDeviceOptions& options = {});

/// An in-order queue of host work outside any HostDevice's own streams: what an outside
/// trainer's stream (PyTorch's current stream, say) is on a GPU. native() is the handle a
/// HostDevice takes as a native stream (Device::RecordEventOnNativeStream). Destruction runs
/// what is queued first. Thread-safe.
class HostStream {
 public:
  HostStream();
  ~HostStream();
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  /// Queues `work`; it runs after everything queued before it.
  void Enqueue(HostFunction work);
  /// Blocks until everything queued so far has run.
  void Synchronize();
  void* native() { return this; }

 private:
  class Worker;
  std::unique_ptr<Worker> worker_;
};

}  // namespace strata
