// Host<->device copy bandwidth per transfer size, through the Device interface: what
// `strata bench all` charts and `strata plan --measure` uses for the host<->device links.
//
// The device measured is the one Strata trains on here: the first GPU when this build has CUDA
// and the machine a GPU (copies over PCIe or NVLink-C2C from pinned memory), else HostDevice,
// whose copies are memcpy between host buffers (no GPU: not a PCIe figure, and said so).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "strata/core/device.h"
#include "strata/core/status.h"

namespace strata::tools {

struct CopyBenchSettings {
  /// Transfer sizes, each a positive multiple of 4 KiB.
  std::vector<uint64_t> sizes = {64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  /// Copies of each size move at least this many bytes (and at least 4 copies).
  uint64_t bytes_per_size = uint64_t{512} << 20;
};

struct CopyPoint {
  std::string direction;  ///< "host_to_device" or "device_to_host".
  uint64_t bytes = 0;     ///< One transfer.
  int copies = 0;         ///< Queued back to back on the direction's stream.
  double seconds = 0.0;   ///< Per copy: the batch's wall time over `copies`.
  double bytes_per_second() const { return seconds > 0 ? bytes / seconds : 0.0; }
};

/// The device to measure (see the file comment), with a memory budget of `budget_bytes`.
Result<std::unique_ptr<Device>> OpenTrainingDevice(uint64_t budget_bytes);

/// Times copies of each size in both directions from pinned host memory. Errors: the device's
/// (ResourceExhausted when the largest size does not fit its budget).
Result<std::vector<CopyPoint>> RunCopyBench(Device& device, const CopyBenchSettings& settings);

/// {"direction", "bytes", "copies", "seconds", "bytes_per_second"}.
nlohmann::ordered_json ToJson(const CopyPoint& point);

}  // namespace strata::tools
