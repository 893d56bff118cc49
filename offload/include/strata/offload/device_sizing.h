// Device sizing: the device memory budget that fits a model when the user gave none, the one
// policy `strata train` (tools/src/train_setup.cpp) and strata.torch (python/src/module.cpp)
// both size HostDevice with.
#pragma once

#include <cstdint>
#include <span>

#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/offload/chunk_layout.h"

namespace strata::offload {

/// What a device budget sized to a model has to hold (DeviceBytesToFit).
enum class DeviceFit {
  /// Every chunk resident, whatever the home of its parameters: each chunk's parameters and
  /// gradients (rounded to pages), the optimizer states the device keeps (all of them with
  /// placement.optimizer_states = device, else the 1 - offload_ratio share not offloaded) plus
  /// one more chunk's states where it keeps any, two chunks of staging and 16 MiB. For
  /// strata.torch on CPU tensors, whose device memory is the host's own: holding less there
  /// saves nothing, and the torch-side tensors view the chunks in place.
  kAllChunks,
  /// What the placement needs: with parameters offloaded (placement.params host or nvme),
  /// three of the largest chunk's parameters and gradients (a layer's chunks plus one fetched
  /// ahead), a fraction of the model; with parameters on the device, all of them with room to
  /// spare: twice each element's working parameter and 12 bytes of fp32 states, plus 16 MiB.
  /// For `strata train`, whose default budget shows what offloading the parameters saves.
  kPlacement,
};

/// The device memory budget (bytes) that fits `parameters` laid out in chunks as the engine
/// lays them out under `options` (precision.working_dtype, placement.chunk_bytes) across
/// `ranks` data-parallel ranks (the padding sharding adds to every chunk counts), for `fit`.
/// A budget the user gave wins over this one; the callers only ask when there is none.
/// InvalidArgument where ChunkLayout::Build refuses the parameters. Pure: thread-safe.
Result<uint64_t> DeviceBytesToFit(const EngineOptions& options,
                                  std::span<const ParameterSpec> parameters, DeviceFit fit,
                                  int ranks = 1);

}  // namespace strata::offload
