// Tier: where a copy of some training state lives.
#pragma once

#include <string_view>

#include "strata/core/status.h"

namespace strata {

/// The three memory tiers, fastest first.
enum class Tier : int {
  kDevice = 0,  ///< Accelerator memory (GPU HBM, or budgeted host memory on HostDevice).
  kHost = 1,    ///< Pinned host DRAM.
  kNvme = 2,    ///< Swap files on one or more NVMe paths.
};

inline constexpr int kTierCount = 3;

/// "device", "host" or "nvme".
std::string_view TierName(Tier tier);

/// Parses "device", "host" or "nvme", case-insensitive. Also accepts "gpu" and "cuda" for device,
/// and DeepSpeed's offload device names: "cpu" for host and "none" (not offloaded) for device.
Result<Tier> ParseTier(std::string_view text);

}  // namespace strata
