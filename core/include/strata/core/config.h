// Loading EngineOptions from JSON: Strata's own format, or a DeepSpeed config.
//
// Strata's format mirrors the EngineOptions tree (sections device, host, nvme, optimizer,
// precision, placement; snake_case field names); unknown keys are errors. A DeepSpeed config
// (the ds_config.json given to deepspeed.initialize) is mapped key by key onto EngineOptions;
// keys Strata does not use are reported, not rejected. docs/config.md has the full mapping.
//
// All functions are thread-safe and do not throw.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/options.h"
#include "strata/core/status.h"

namespace strata {

/// The dialect of a config document.
enum class ConfigFormat : int {
  kAuto = 0,       ///< Decide from the document's keys (see ParseConfig).
  kStrata = 1,     ///< Strata's own format.
  kDeepSpeed = 2,  ///< A DeepSpeed config.
};

/// "auto", "strata" or "deepspeed".
std::string_view ConfigFormatName(ConfigFormat format);

/// What a config document turned into.
struct LoadedConfig {
  /// The options, already validated.
  EngineOptions options;
  /// The format the document was read as: kStrata or kDeepSpeed, never kAuto.
  ConfigFormat format = ConfigFormat::kStrata;
  /// DeepSpeed only: full dotted paths of keys Strata does not use, in document order
  /// (e.g. "train_batch_size", "zero_optimization.overlap_comm"). Always empty for kStrata.
  std::vector<std::string> ignored_keys;
  /// DeepSpeed only: one note per value given as "auto", as "key: auto -> value"
  /// (e.g. "optimizer.params.lr: auto -> 0.001").
  std::vector<std::string> auto_resolved;
  /// DeepSpeed only: train_batch_size and train_micro_batch_size_per_gpu, given or derived as
  /// DeepSpeed derives them (train_batch_size = micro batch x gradient_accumulation_steps x
  /// world size; the missing one of the three from the other two), so gradient accumulation
  /// follows from "train_batch_size": 24, "train_micro_batch_size_per_gpu": 3 as it does in
  /// DeepSpeed. Unset when the config gives neither (the trainer chooses).
  std::optional<int64_t> train_batch_size;
  /// Whether the document has an "optimizer" section. Without one a DeepSpeed config leaves
  /// the optimizer to the trainer (deepspeed.initialize's optimizer argument): a trainer with
  /// defaults of its own keeps them.
  bool has_optimizer = false;
  /// Whether the document gives `placement.chunk_bytes` (a Strata config; DeepSpeed has no such
  /// key). Chunking is the engine's, not the model's: a trainer with a chunk size of its own
  /// keeps it unless the document names one.
  bool has_chunk_bytes = false;
  std::optional<int64_t> micro_batch_size;
};

/// Parses a config document and validates the result (EngineOptions::Validate).
///
/// With kAuto the document is read as DeepSpeed when it has any DeepSpeed top-level key
/// (zero_optimization, train_batch_size, fp16, bf16, aio, ...) and no Strata section other than
/// "optimizer", and as Strata when it has Strata sections and no DeepSpeed key. Otherwise the
/// shape of "optimizer" decides ("params" inside it is DeepSpeed; Strata fields such as "lr"
/// are Strata); a document with no such clue and keys of both kinds is an InvalidArgument
/// error asking for an explicit format. A document with neither is read as Strata.
///
/// JSON comments (// and /* */) are allowed. Errors are InvalidArgument and start with
/// `source` (a file name, or "<string>"): malformed JSON gives the parser's byte, line and
/// column; a bad value gives its key path, the value and what was expected, e.g.
/// "ds.json: zero_optimization.offload_optimizer.buffer_count: expected a positive integer,
/// got -2".
///
/// `world_size` is the number of data-parallel ranks the config will run on: DeepSpeed's batch
/// sizes are checked and derived with it.
Result<LoadedConfig> ParseConfig(std::string_view json_text,
                                 ConfigFormat format = ConfigFormat::kAuto,
                                 std::string_view source = "<string>", int world_size = 1);

/// Reads the file at `path` and parses it as ParseConfig does, with `path` as the source.
/// NotFound when the file does not exist; IoError (naming the path) when it cannot be read.
Result<LoadedConfig> LoadConfigFile(const std::string& path,
                                    ConfigFormat format = ConfigFormat::kAuto, int world_size = 1);

/// One line listing every ignored DeepSpeed key, for a log warning, e.g.
/// "DeepSpeed config keys not used by Strata (ignored): train_batch_size, scheduler";
/// "" when there are none.
std::string IgnoredKeysWarning(const LoadedConfig& config);

/// The options as pretty-printed JSON in Strata's format, every field written (sizes as
/// strings like "64MiB" where that is exact). For options that pass Validate(),
/// ParseConfig(OptionsToJson(o)) gives back options equal to `o`.
std::string OptionsToJson(const EngineOptions& options);

}  // namespace strata
