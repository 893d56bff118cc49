#include "copy_bench.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "strata/core/aligned_buffer.h"
#include "strata/core/cuda_device.h"
#include "strata/core/host_device.h"

namespace strata::tools {

Result<std::unique_ptr<Device>> OpenTrainingDevice(uint64_t budget_bytes) {
  if (Result<std::unique_ptr<Device>> gpu = CreateCudaDevice({.memory_budget_bytes = budget_bytes});
      gpu.ok()) {
    return gpu;
  }
  return CreateHostDevice({.memory_budget_bytes = budget_bytes});
}

Result<std::vector<CopyPoint>> RunCopyBench(Device& device, const CopyBenchSettings& settings) {
  if (settings.sizes.empty()) return InvalidArgument("no copy sizes to measure");
  const uint64_t largest = *std::max_element(settings.sizes.begin(), settings.sizes.end());
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer host, AlignedBuffer::Allocate(largest));
  std::memset(host.data(), 0x5a, largest);
  PinnedHostRegion pinned;
  if (device.CanPin()) {
    STRATA_ASSIGN_OR_RETURN(pinned, device.PinHostMemory(host.data(), largest));
  }
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer on_device, device.Allocate(largest));

  std::vector<CopyPoint> points;
  for (uint64_t size : settings.sizes) {
    for (const Stream stream : {Stream::kHostToDevice, Stream::kDeviceToHost}) {
      const bool up = stream == Stream::kHostToDevice;
      const char* direction = up ? "host_to_device" : "device_to_host";
      auto copy = [&] {
        return up ? device.CopyToDevice(on_device.data(), host.data(), size, stream)
                  : device.CopyToHost(host.data(), on_device.data(), size, stream);
      };
      STRATA_RETURN_IF_ERROR(copy());  // Warm-up: first-touch and driver set-up, unmeasured.
      STRATA_RETURN_IF_ERROR(device.SynchronizeStream(stream));
      const int copies = int(std::max<uint64_t>(4, settings.bytes_per_size / size));
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < copies; ++i) STRATA_RETURN_IF_ERROR(copy());
      STRATA_RETURN_IF_ERROR(device.SynchronizeStream(stream));
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      points.push_back({direction, size, copies, seconds / copies});
    }
  }
  return points;
}

nlohmann::ordered_json ToJson(const CopyPoint& p) {
  return {{"direction", p.direction},
          {"bytes", p.bytes},
          {"copies", p.copies},
          {"seconds", p.seconds},
          {"bytes_per_second", p.bytes_per_second()}};
}

}  // namespace strata::tools
