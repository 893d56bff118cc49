// CpuUpdater: optimizer steps on the CPU's vectorized kernels (cpu_adam), over states in host
// memory, or in a device's memory when that is the CPU's own (a HostDevice).
#pragma once

#include "update/updater.h"

namespace strata::offload {

class CpuUpdater final : public Updater {
 public:
  /// Whether it can step states kept in `tier` beside `device`: host and NVMe-kept states
  /// always (they are updated in host memory); device-kept ones on a HostDevice, whose memory
  /// the CPU addresses, and never a GPU's.
  static bool Serves(const Device& device, Tier tier);
  static Result<std::unique_ptr<Updater>> Make(const UpdaterContext& context);

  explicit CpuUpdater(cpu_adam::CpuOptimizer& cpu) : cpu_(cpu) {}

  std::string name() const override { return "cpu"; }
  bool queues_on_device() const override { return false; }
  Status Update(const ChunkUpdate& update) override;

 private:
  cpu_adam::CpuOptimizer& cpu_;
};

}  // namespace strata::offload
