// What an engine checkpoint's manifest says, read and checked against the engine's layout before
// Load touches anything: the manifest is outside input (a file anyone may have edited), so every
// field is checked for presence, type and range here, in one place, and fuzzed
// (tests/fuzz/manifest_fuzzer.cpp).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint_files.h"
#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/offload/chunk_layout.h"
#include "strata/offload/loss_scaler.h"

namespace strata::offload::internal {

/// The largest step or iteration count a checkpoint holds (exact in a double, far from
/// overflowing when the next step adds one); Load refuses more, so nothing may set more.
inline constexpr int64_t kMaxCheckpointCount = int64_t{1} << 53;

/// "chunk-000007.bin": the data file of a chunk.
std::string ChunkFileName(size_t chunk);

/// The engine's part of a manifest, for a layout it matched.
struct EngineManifest {
  int64_t step_count = 0;
  DType working_dtype = DType::kBf16;  ///< What it was trained in: the scaler state is fp16's.
  LossScalerState scaler;
  std::vector<FileDigest> digests;   ///< Per chunk: its file's size and hash.
  std::vector<int64_t> chunk_steps;  ///< Per chunk: updates it took (0 when it starts afresh).
};

/// Reads `manifest` (already checked by CheckpointReader::Open for format and version) for an
/// engine whose layout is `layout` and whose optimizer is `optimizer`. InvalidArgument, saying
/// why, when the checkpoint holds other parameters, shapes or packing, or moments of an optimizer
/// whose moments mean something else (Adam's and AdamW's are the same); DataLoss naming the
/// field when one is missing, of the wrong type or out of range (a negative step count or one
/// past 2^53, a loss scale that is not a positive number, a chunk file of a size no chunk of
/// that layout has).
///
/// A chunk saved frozen holds its values only and one saved trained its states; either loads
/// into either, and `chunk_steps` is 0 for a chunk whose moments start afresh (unfrozen now, or
/// frozen now).
Result<EngineManifest> ReadEngineManifest(const nlohmann::json& manifest, const ChunkLayout& layout,
                                          OptimizerType optimizer);

}  // namespace strata::offload::internal
