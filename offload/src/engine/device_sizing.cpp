#include "strata/offload/device_sizing.h"

#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/tier.h"

namespace strata::offload {
namespace {

/// Room for what the budget does not count chunk by chunk (small allocations, alignment).
constexpr uint64_t kSlackBytes = 16 * kMiB;

uint64_t AllChunksBytes(const EngineOptions& options, const ChunkLayout& layout) {
  const DType dtype = options.precision.working_dtype;
  uint64_t working = 0;
  uint64_t states = 0;
  for (const ChunkInfo& chunk : layout.chunks()) {
    working += ChunkDeviceBytes(chunk.numel, dtype);
    if (!chunk.frozen) states += ChunkStateBytes(chunk.numel);
  }
  const double kept_on_device = options.placement.optimizer_states == Tier::kDevice
                                    ? 1.0
                                    : 1.0 - options.placement.offload_ratio;
  const uint64_t largest = layout.max_chunk_numel();
  return working + uint64_t(kept_on_device * double(states)) +
         (kept_on_device > 0.0 ? ChunkStateBytes(largest) : 0) +
         2 * ChunkDeviceBytes(largest, dtype) + kSlackBytes;
}

uint64_t PlacementBytes(const EngineOptions& options, const ChunkLayout& layout) {
  const DType dtype = options.precision.working_dtype;
  if (options.placement.params != Tier::kDevice) {
    return 3 * ChunkDeviceBytes(layout.max_chunk_numel(), dtype);
  }
  return 2 * layout.total_numel() * (DTypeSize(dtype) + 12) + kSlackBytes;
}

}  // namespace

Result<uint64_t> DeviceBytesToFit(const EngineOptions& options,
                                  std::span<const ParameterSpec> parameters, DeviceFit fit,
                                  int ranks) {
  STRATA_ASSIGN_OR_RETURN(ChunkLayout layout,
                          ChunkLayout::Build(parameters, options.precision.working_dtype,
                                             options.placement.chunk_bytes, ranks));
  switch (fit) {
    case DeviceFit::kAllChunks: return AllChunksBytes(options, layout);
    case DeviceFit::kPlacement: return PlacementBytes(options, layout);
  }
  return AllChunksBytes(options, layout);
}

}  // namespace strata::offload
