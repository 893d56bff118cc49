// What an engine checkpoint's manifest says, read and checked against the engine's layout before
// Load touches anything: the manifest is outside input (a file anyone may have edited), so every
// field is checked for presence, type and range here, in one place, and fuzzed
// (tests/fuzz/manifest_fuzzer.cpp).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_files.h"
#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/offload/chunk_layout.h"
#include "strata/offload/loss_scaler.h"

namespace strata::offload::internal {

/// The largest step or iteration count a checkpoint holds (exact in a double, far from
/// overflowing when the next step adds one); Load refuses more, so nothing may set more.
inline constexpr int64_t kMaxCheckpointCount = int64_t{1} << 53;

/// The manifest "version" of a checkpoint saved by several ranks (engine.world_size > 1, trained
/// chunks in shard files). One rank saves version 1, which every build reads.
inline constexpr int kShardedCheckpointVersion = 2;

/// "chunk-000007.bin": the data file of a chunk saved whole (one rank, or a frozen chunk).
std::string ChunkFileName(size_t chunk);
/// "chunk-000007.rank-00001-of-00002.bin": rank 1's shard of chunk 7 saved by 2 ranks.
std::string ChunkShardFileName(size_t chunk, int rank, int world_size);

/// One chunk as a checkpoint holds it.
struct SavedChunk {
  /// Elements, padded for the world size it was saved with: each of `files` holds
  /// numel / files.size() of them when trained.
  size_t numel = 0;
  /// Holds optimizer states (fp32 master | exp_avg | exp_avg_sq), else its values only (fp32).
  bool trained = false;
  /// Its files in rank order: one per saving rank for a trained chunk saved by several ranks
  /// (ChunkShardFileName), else one (ChunkFileName).
  std::vector<std::string> names;
  std::vector<FileDigest> files;
};

/// The engine's part of a manifest, for a layout it matched.
struct EngineManifest {
  int64_t step_count = 0;
  DType working_dtype = DType::kBf16;  ///< What it was trained in: the scaler state is fp16's.
  LossScalerState scaler;
  int world_size = 1;                ///< Ranks that saved it.
  std::vector<SavedChunk> chunks;    ///< Per chunk: its files.
  std::vector<int64_t> chunk_steps;  ///< Per chunk: updates it took (0 when it starts afresh).
};

/// Reads `manifest` (already checked by CheckpointReader::Open for format and version) for an
/// engine whose layout is `layout` and whose optimizer is `optimizer`, whatever world size either
/// has (chunks differ only in their padding). InvalidArgument, saying
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
