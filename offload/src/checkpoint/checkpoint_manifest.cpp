#include "checkpoint/checkpoint_manifest.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <string_view>
#include <type_traits>

namespace strata::offload::internal {

using nlohmann::json;

std::string ChunkFileName(size_t chunk) {
  char name[32];
  std::snprintf(name, sizeof(name), "chunk-%06zu.bin", chunk);
  return name;
}

std::string ChunkShardFileName(size_t chunk, int rank, int world_size) {
  char name[64];
  std::snprintf(name, sizeof(name), "chunk-%06zu.rank-%05d-of-%05d.bin", chunk, rank, world_size);
  return name;
}

namespace {

/// A field missing, of the wrong type or out of range: thrown by Field() and the checks below,
/// caught once in ReadEngineManifest and returned as DataLoss. `field` is its path, such as
/// "chunks[1].xxh3".
struct BadField {
  std::string field;
  std::string problem;
};

std::string Show(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  return text.size() > 40 ? text.substr(0, 37) + "..." : text;
}

std::string Path(const std::string& parent, std::string_view key) {
  return parent.empty() ? std::string(key) : parent + "." + std::string(key);
}

const json& Member(const json& object, const std::string& path, std::string_view key) {
  if (!object.is_object()) throw BadField{path, "is " + Show(object) + ", not an object"};
  const auto it = object.find(key);
  if (it == object.end()) throw BadField{Path(path, key), "is missing"};
  return *it;
}

const json& Array(const json& object, const std::string& path, std::string_view key) {
  const json& value = Member(object, path, key);
  if (!value.is_array()) throw BadField{Path(path, key), "is " + Show(value) + ", not an array"};
  return value;
}

/// `object[key]` as a T, which it must be exactly: nlohmann would turn 2.5 into 2 and -1 into
/// 2^64-1 without a word.
template <typename T>
T Field(const json& object, const std::string& path, std::string_view key) {
  const json& value = Member(object, path, key);
  bool fits = false;
  const char* expected = "";
  if constexpr (std::is_same_v<T, bool>) {
    fits = value.is_boolean(), expected = "a boolean";
  } else if constexpr (std::is_same_v<T, std::string>) {
    fits = value.is_string(), expected = "a string";
  } else if constexpr (std::is_floating_point_v<T>) {
    fits = value.is_number(), expected = "a number";
  } else {
    static_assert(std::is_integral_v<T>);
    // Parsed non-negative integers are unsigned in nlohmann, assigned ones may be signed.
    if (value.is_number_unsigned()) {
      fits = value.get<uint64_t>() <= uint64_t(std::numeric_limits<T>::max());
    } else if (value.is_number_integer()) {
      const int64_t v = value.get<int64_t>();
      fits = v >= 0 ? uint64_t(v) <= uint64_t(std::numeric_limits<T>::max())
                    : std::is_signed_v<T> && v >= int64_t(std::numeric_limits<T>::min());
    }
    expected = std::is_unsigned_v<T> ? "an unsigned integer" : "an integer";
  }
  if (!fits) throw BadField{Path(path, key), "is " + Show(value) + ", not " + expected};
  return value.get<T>();
}

std::vector<int64_t> Shape(const json& object, const std::string& path) {
  const json& shape = Array(object, path, "shape");
  std::vector<int64_t> dims;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (!shape[d].is_number_integer() ||
        (shape[d].is_number_unsigned() && shape[d].get<uint64_t>() > uint64_t(INT64_MAX))) {
      throw BadField{Path(path, "shape"), "is " + Show(shape) + ", not a list of integers"};
    }
    dims.push_back(shape[d].get<int64_t>());
  }
  return dims;
}

std::string Element(std::string_view array, size_t i) {
  return std::string(array) + "[" + std::to_string(i) + "]";
}

/// The first parameter frozen in the checkpoint and not in the engine, or the other way round:
/// "'name' frozen then, trained now".
std::optional<std::string> FrozenDifference(const json& params, const json& chunks,
                                            const ChunkLayout& layout) {
  for (size_t p = 0; p < params.size() && p < layout.parameter_count(); ++p) {
    const size_t chunk = Field<size_t>(params[p], Element("parameters", p), "chunk");
    if (chunk >= chunks.size() || !chunks[chunk].is_object()) return std::nullopt;
    const bool then = chunks[chunk].contains("frozen") &&
                      Field<bool>(chunks[chunk], Element("chunks", chunk), "frozen");
    const bool now = layout.chunk(layout.location(p).chunk).frozen;
    if (then != now) {
      return "'" + layout.name(p) + "' " +
             (then ? "frozen then, trained now" : "trained then, frozen now");
    }
  }
  return std::nullopt;
}

/// InvalidArgument unless the checkpoint's parameters are exactly the registered ones, packed
/// the same way.
Status CheckLayoutMatches(const json& manifest, const ChunkLayout& layout) {
  const json& params = Array(manifest, "", "parameters");
  const json& chunks = Array(manifest, "", "chunks");
  if (params.size() != layout.parameter_count()) {
    return InvalidArgument("the checkpoint has " + std::to_string(params.size()) +
                           " parameters; the engine has " +
                           std::to_string(layout.parameter_count()));
  }
  for (size_t p = 0; p < params.size(); ++p) {
    const json& saved = params[p];
    const std::string path = Element("parameters", p);
    const std::string name = Field<std::string>(saved, path, "name");
    if (name != layout.name(p)) {
      return InvalidArgument("parameter " + std::to_string(p) + " is '" + layout.name(p) +
                             "' in the engine but '" + name + "' in the checkpoint");
    }
    if (Shape(saved, path) != layout.shape(p)) {
      return InvalidArgument("parameter '" + name + "' has shape " + saved.at("shape").dump() +
                             " in the checkpoint but " + json(layout.shape(p)).dump() +
                             " in the engine");
    }
    if (Field<size_t>(saved, path, "chunk") != layout.location(p).chunk ||
        Field<size_t>(saved, path, "offset") != layout.location(p).offset) {
      if (std::optional<std::string> frozen = FrozenDifference(params, chunks, layout)) {
        return InvalidArgument(
            "parameter '" + name + "' is packed differently in the checkpoint, which was saved " +
            "with other parameters frozen (" + *frozen +
            "); frozen and trained parameters never share a chunk, so the packing follows them. "
            "Freeze what fills whole chunks, or move the states across with "
            "ReadParameterState and WriteParameterState");
      }
      // chunk_bytes counts working-parameter bytes, so another precision packs other chunks
      // with the same chunk_bytes: both must be the checkpoint's.
      const json& engine = Member(manifest, "", "engine");
      return InvalidArgument(
          "parameter '" + name +
          "' is packed differently in the checkpoint, which was saved with precision " +
          Show(Member(engine, "engine", "working_dtype")) + " and chunk_bytes " +
          Show(Member(engine, "engine", "chunk_bytes")) +
          "; chunk_bytes counts bytes of working parameters, so another precision packs other "
          "chunks: load it with that precision and chunk_bytes");
    }
  }
  if (chunks.size() != layout.chunk_count()) {
    return InvalidArgument("the checkpoint has " + std::to_string(chunks.size()) +
                           " chunks; the engine has " + std::to_string(layout.chunk_count()));
  }
  return Status();
}

/// The ranks that saved the checkpoint: engine.world_size, 1 where absent (one rank's).
int WorldSize(const json& engine) {
  if (!engine.contains("world_size")) return 1;
  const int world_size = Field<int>(engine, "engine", "world_size");
  if (world_size < 1 || world_size > (1 << 24)) {
    throw BadField{"engine.world_size",
                   "is " + std::to_string(world_size) + "; it is in [1, 16777216]"};
  }
  return world_size;
}

/// Chunk `i`'s file: its name, size and hash at `object` (a chunk, or one of its shards).
FileDigest Digest(const json& object, const std::string& path) {
  return {Field<uint64_t>(object, path, "bytes"), Field<uint64_t>(object, path, "xxh3")};
}

/// Chunk `i` of the manifest, whose parameters `layout` packs alike: its size must be the
/// layout's chunk padded for `world_size` ranks, its files those of a trained or a frozen chunk.
Result<SavedChunk> ReadChunk(const json& chunk, size_t i, const ChunkLayout& layout,
                             int world_size) {
  const std::string path = Element("chunks", i);
  SavedChunk saved;
  saved.numel = Field<size_t>(chunk, path, "numel");
  const size_t unit = kChunkAlignment * size_t(world_size);
  if (saved.numel != (layout.chunk(i).used_numel + unit - 1) / unit * unit) {
    return InvalidArgument("chunk " + std::to_string(i) + " has a different size in the " +
                           "checkpoint");
  }
  if (chunk.contains("shards")) {
    // A trained chunk saved by several ranks: a file per rank, each a shard's states.
    const json& shards = Array(chunk, path, "shards");
    if (world_size == 1 || shards.size() != size_t(world_size)) {
      throw BadField{path + ".shards", "has " + std::to_string(shards.size()) +
                                           " files; engine.world_size says " +
                                           std::to_string(world_size)};
    }
    saved.trained = true;
    const uint64_t bytes = ChunkStateBytes(saved.numel / size_t(world_size));
    for (size_t r = 0; r < shards.size(); ++r) {
      const std::string shard_path = path + Element(".shards", r);
      saved.files.push_back(Digest(shards[r], shard_path));
      saved.names.push_back(ChunkShardFileName(i, int(r), world_size));
      if (saved.files.back().bytes != bytes) {
        return DataLoss("checkpoint file " + saved.names.back() + " holds " +
                        std::to_string(saved.files.back().bytes) + " bytes; a shard of chunk " +
                        std::to_string(i) + " needs " + std::to_string(bytes));
      }
    }
  } else {
    // A chunk saved whole: its states (one rank) or its values (frozen).
    saved.files.push_back(Digest(chunk, path));
    saved.names.push_back(ChunkFileName(i));
    const uint64_t bytes = saved.files.back().bytes;
    saved.trained = world_size == 1 && bytes == ChunkStateBytes(saved.numel);
    if (!saved.trained && bytes != saved.numel * sizeof(float)) {
      return DataLoss("checkpoint file " + ChunkFileName(i) + " holds " + std::to_string(bytes) +
                      " bytes; chunk " + std::to_string(i) + " needs " +
                      std::to_string(ChunkStateBytes(saved.numel)) + " (or " +
                      std::to_string(saved.numel * sizeof(float)) + " if it was frozen)");
    }
  }
  if (chunk.contains("frozen") && Field<bool>(chunk, path, "frozen") == saved.trained) {
    throw BadField{path + ".frozen", std::string("is ") + (saved.trained ? "true" : "false") +
                                         " but its files are those of a " +
                                         (saved.trained ? "trained" : "frozen") + " chunk"};
  }
  return saved;
}

int64_t Count(const json& object, const std::string& path, std::string_view key) {
  const int64_t count = Field<int64_t>(object, path, key);
  if (count < 0 || count > kMaxCheckpointCount) {
    throw BadField{Path(path, key), "is " + std::to_string(count) + "; a count is in [0, 2^53]"};
  }
  return count;
}

/// Adam and AdamW keep the same moments; the others keep their own kinds.
int MomentKind(OptimizerType type) {
  return type == OptimizerType::kAdam ? int(OptimizerType::kAdamW) : int(type);
}

Status CheckOptimizer(const json& engine, OptimizerType optimizer) {
  const std::string saved_name = Field<std::string>(engine, "engine", "optimizer");
  const Result<OptimizerType> saved = ParseOptimizerType(saved_name);
  if (!saved.ok()) throw BadField{"engine.optimizer", "is \"" + saved_name + "\", not known"};
  if (MomentKind(*saved) != MomentKind(optimizer)) {
    return InvalidArgument("the checkpoint holds " + saved_name +
                           "'s optimizer states and this "
                           "engine runs " +
                           std::string(OptimizerTypeName(optimizer)) +
                           ", whose states mean something else; load it with " + saved_name +
                           ", or carry only the weights over (ReadParameterState of kMaster "
                           "there, WriteParameterState here)");
  }
  return Status();
}

LossScalerState ReadScaler(const json& engine) {
  const std::string path = "engine.loss_scaler";
  const json& s = Member(engine, "engine", "loss_scaler");
  const LossScalerState scaler = {
      .scale = Field<double>(s, path, "scale"),
      .iteration = Count(s, path, "iteration"),
      .last_overflow_iteration = Field<int64_t>(s, path, "last_overflow_iteration"),
      .hysteresis_left = Field<int>(s, path, "hysteresis_left")};
  if (!std::isfinite(scaler.scale) || scaler.scale <= 0.0) {
    throw BadField{path + ".scale", "is " + Show(s["scale"]) + "; a loss scale is positive"};
  }
  if (scaler.last_overflow_iteration < -1 || scaler.last_overflow_iteration > scaler.iteration) {
    throw BadField{path + ".last_overflow_iteration",
                   "is " + std::to_string(scaler.last_overflow_iteration) +
                       "; it is -1 (none) or an iteration up to " +
                       std::to_string(scaler.iteration)};
  }
  if (scaler.hysteresis_left < 1) {
    throw BadField{path + ".hysteresis_left", "is " + std::to_string(scaler.hysteresis_left) +
                                                  "; at least 1 overflow is tolerated"};
  }
  return scaler;
}

}  // namespace

Result<EngineManifest> ReadEngineManifest(const json& manifest, const ChunkLayout& layout,
                                          OptimizerType optimizer) {
  EngineManifest saved;
  try {
    STRATA_RETURN_IF_ERROR(CheckLayoutMatches(manifest, layout));
    const json& engine = Member(manifest, "", "engine");
    STRATA_RETURN_IF_ERROR(CheckOptimizer(engine, optimizer));
    saved.step_count = Count(engine, "engine", "step_count");
    const std::string dtype = Field<std::string>(engine, "engine", "working_dtype");
    const Result<DType> working_dtype = ParseDType(dtype);
    if (!working_dtype.ok()) {
      throw BadField{"engine.working_dtype", "is \"" + dtype + "\", not a dtype"};
    }
    saved.working_dtype = *working_dtype;
    saved.scaler = ReadScaler(engine);
    saved.world_size = WorldSize(engine);
    const json& chunks = manifest.at("chunks");  // An array of layout.chunk_count(): checked.
    for (size_t i = 0; i < chunks.size(); ++i) {
      const json& chunk = chunks[i];
      const std::string path = Element("chunks", i);
      STRATA_ASSIGN_OR_RETURN(SavedChunk saved_chunk,
                              ReadChunk(chunk, i, layout, saved.world_size));
      const bool saved_trained = saved_chunk.trained;
      // Checkpoints from before per-chunk step counts: every chunk took every step.
      int64_t steps = saved.step_count;
      if (chunk.contains("steps")) {
        steps = Count(chunk, path, "steps");
        if (steps > saved.step_count) {
          throw BadField{path + ".steps", "is " + std::to_string(steps) +
                                              "; a chunk takes between 0 and step_count (" +
                                              std::to_string(saved.step_count) + ") updates"};
        }
      }
      // Moments start afresh for a chunk frozen now or frozen then.
      if (layout.chunk(i).frozen || !saved_trained) steps = 0;
      saved.chunks.push_back(std::move(saved_chunk));
      saved.chunk_steps.push_back(steps);
    }
  } catch (const BadField& bad) {
    return DataLoss("checkpoint manifest: " + bad.field + " " + bad.problem);
  } catch (const json::exception& e) {
    // Not expected past the checks above; kept so that no manifest can throw out of Load.
    return DataLoss(std::string("checkpoint manifest: ") + e.what());
  }
  return saved;
}

}  // namespace strata::offload::internal
