// Config loading: the reader (the file, the JSON parse, the format's detection) in front of the
// two dialects, Strata's (config_strata.cpp) and DeepSpeed's (config_deepspeed.cpp), which read
// with config_reader.h.
//
// nlohmann::json is used only in these files. Its exceptions are caught here: the parser's to
// report malformed input with its position, and any other as a last-resort Internal error, so
// none crosses the API.
#include "strata/core/config.h"

#include <array>
#include <exception>
#include <functional>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "config_reader.h"
#include "deepspeed_keys.h"
#include "strata/core/input_file.h"

namespace strata {
namespace {

using internal::CheckDeepSpeedKeyKnown;
using internal::CollectUnused;
using internal::ContainsKey;
using internal::Context;
using internal::JoinList;
using internal::JoinPath;
using internal::Json;
using internal::kStrataOnlySections;
using internal::Quote;
using internal::ReadDeepSpeed;
using internal::ReadStrata;
using internal::Show;

// Fields of Strata's "optimizer" section that a DeepSpeed "optimizer" never has at its top.
constexpr auto kStrataOptimizerFields = std::to_array<std::string_view>(
    {"lr", "beta1", "beta2", "eps", "weight_decay", "bias_correction", "gradient_clipping",
     "gradient_accumulation_steps", "cpu_threads", "speculative_updates", "recheck_gradients",
     "delayed_update", "delayed_update_from_step"});

// --- Format detection ----------------------------------------------------------------------

Result<ConfigFormat> DetectFormat(const Json& doc, std::string_view source) {
  std::vector<std::string> deepspeed_keys;
  std::vector<std::string> strata_sections;
  for (const auto& item : doc.items()) {
    // "optimizer" is in both formats.
    if (item.key() != "optimizer" && ContainsKey(internal::DeepSpeedTopLevelKeys(), item.key())) {
      deepspeed_keys.push_back(item.key());
    }
    if (ContainsKey(kStrataOnlySections, item.key())) strata_sections.push_back(item.key());
  }
  if (!deepspeed_keys.empty() && strata_sections.empty()) return ConfigFormat::kDeepSpeed;
  if (deepspeed_keys.empty() && !strata_sections.empty()) return ConfigFormat::kStrata;

  // Ambiguous: the shape of "optimizer" decides.
  auto optimizer = doc.find("optimizer");
  if (optimizer != doc.end() && optimizer->is_object()) {
    if (optimizer->contains("params")) return ConfigFormat::kDeepSpeed;
    for (std::string_view field : kStrataOptimizerFields) {
      if (optimizer->contains(std::string(field))) return ConfigFormat::kStrata;
    }
  }
  if (deepspeed_keys.empty()) return ConfigFormat::kStrata;  // Nothing to go by: defaults.
  return InvalidArgument(std::string(source) +
                         ": cannot tell whether this is a DeepSpeed or a Strata config: it has "
                         "DeepSpeed keys (" +
                         JoinList(deepspeed_keys) + ") and Strata sections (" +
                         JoinList(strata_sections) +
                         "); use one format, or pass --format strata or --format deepspeed "
                         "(ConfigFormat::kStrata or kDeepSpeed in the C++ API)");
}

// Finds the first key given twice in one object while the document is parsed: JSON allows it
// (the last would win), DeepSpeed's loader refuses it, and so does Strata. Also stops nesting
// deeper than any config needs, which would otherwise make printing a value recurse that deep.
class DuplicateKeyFinder {
 public:
  static constexpr int kMaxDepth = 64;

  bool operator()(int depth, Json::parse_event_t event, Json& parsed) {
    using Event = Json::parse_event_t;
    if (depth > kMaxDepth) {
      too_deep_ = true;
      return false;  // Dropped: the document is refused after the parse.
    }
    switch (event) {
      case Event::object_start:
      case Event::array_start: {
        std::string path;
        if (!frames_.empty()) {
          const Frame& parent = frames_.back();
          path = parent.is_object ? JoinPath(parent.path, parent.last_key) : parent.path + "[]";
        }
        frames_.push_back({event == Event::object_start, std::move(path), {}, {}});
        break;
      }
      case Event::object_end:
      case Event::array_end:
        if (!frames_.empty()) frames_.pop_back();
        break;
      case Event::key: {
        Frame& frame = frames_.back();
        frame.last_key = parsed.get<std::string>();
        if (!frame.keys.insert(frame.last_key).second && !duplicate_) {
          duplicate_ = JoinPath(frame.path, frame.last_key);
        }
        break;
      }
      case Event::value: break;
    }
    return true;
  }
  /// The full path of the first duplicate ("zero_optimization.stage"), if any.
  const std::optional<std::string>& duplicate() const { return duplicate_; }
  bool too_deep() const { return too_deep_; }

 private:
  struct Frame {
    bool is_object;
    std::string path;
    std::set<std::string> keys;
    std::string last_key;
  };
  std::vector<Frame> frames_;
  std::optional<std::string> duplicate_;
  bool too_deep_ = false;
};

// nlohmann's exception text without its "[json.exception.parse_error.101] " prefix.
std::string ExceptionText(const Json::exception& e) {
  std::string what = e.what();
  if (auto end = what.find("] "); !what.empty() && what[0] == '[' && end != std::string::npos) {
    what.erase(0, end + 2);
  }
  return what;
}

Result<LoadedConfig> ParseConfigImpl(std::string_view json_text, ConfigFormat format,
                                     std::string_view source, int world_size) {
  Json doc;
  DuplicateKeyFinder duplicates;
  try {
    doc = Json::parse(json_text.begin(), json_text.end(), std::ref(duplicates),
                      /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const Json::parse_error& e) {
    return InvalidArgument(std::string(source) + ": malformed JSON at byte " +
                           std::to_string(e.byte) + ": " + ExceptionText(e));
  } catch (const Json::out_of_range& e) {  // A number like 1e400, beyond a double.
    return InvalidArgument(std::string(source) + ": malformed JSON: " + ExceptionText(e) +
                           " (beyond the range of a 64-bit float)");
  }
  if (duplicates.too_deep()) {
    return InvalidArgument(std::string(source) + ": values are nested more than " +
                           std::to_string(DuplicateKeyFinder::kMaxDepth) +
                           " levels deep; no config is");
  }
  if (const std::optional<std::string>& key = duplicates.duplicate()) {
    return InvalidArgument(std::string(source) + ": key " + Quote(*key) +
                           " is given twice; give each key once (DeepSpeed refuses duplicates "
                           "too, where plain JSON would keep the last)");
  }
  if (!doc.is_object()) {
    return InvalidArgument(std::string(source) + ": expected a JSON object at the top level, got " +
                           Show(doc));
  }

  LoadedConfig loaded;
  if (format == ConfigFormat::kAuto) {
    STRATA_ASSIGN_OR_RETURN(format, DetectFormat(doc, source));
  }
  loaded.format = format;
  loaded.has_optimizer = doc.contains("optimizer");
  loaded.has_chunk_bytes = format == ConfigFormat::kStrata && doc.contains("placement") &&
                           doc["placement"].is_object() && doc["placement"].contains("chunk_bytes");

  Context ctx;
  ctx.source = std::string(source);
  ctx.deepspeed = format == ConfigFormat::kDeepSpeed;
  ctx.world_size = world_size;
  if (ctx.deepspeed) {
    const Status read = ReadDeepSpeed(doc, &ctx, &loaded);
    // An unknown key is reported first even when reading failed: a typo ("offload_optimzer")
    // is the likely cause of what then looked wrong.
    std::vector<std::pair<std::string, std::string>> unused;
    CollectUnused(doc, "", ctx, &unused);
    for (auto& [parent, full] : unused) {
      STRATA_RETURN_IF_ERROR(CheckDeepSpeedKeyKnown(ctx, parent, full));
      loaded.ignored_keys.push_back(std::move(full));
    }
    STRATA_RETURN_IF_ERROR(read);
    loaded.auto_resolved = std::move(ctx.auto_resolved);
  } else {
    STRATA_RETURN_IF_ERROR(ReadStrata(doc, &ctx, &loaded.options));
  }
  STRATA_RETURN_IF_ERROR(loaded.options.Validate().WithContext(source));
  return loaded;
}

}  // namespace

std::string_view ConfigFormatName(ConfigFormat format) {
  switch (format) {
    case ConfigFormat::kAuto: return "auto";
    case ConfigFormat::kStrata: return "strata";
    case ConfigFormat::kDeepSpeed: return "deepspeed";
  }
  return "unknown";
}

Result<LoadedConfig> ParseConfig(std::string_view json_text, ConfigFormat format,
                                 std::string_view source, int world_size) {
  if (world_size < 1) {
    return InvalidArgument(std::string(source) + ": world size " + std::to_string(world_size) +
                           " must be >= 1");
  }
  try {
    return ParseConfigImpl(json_text, format, source, world_size);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted(std::string(source) + ": out of memory while reading the config");
  } catch (const std::exception& e) {
    return Internal(std::string(source) +
                    ": unexpected error while reading the config: " + e.what());
  }
}

Result<LoadedConfig> LoadConfigFile(const std::string& path, ConfigFormat format, int world_size) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadInputFile(path, kConfigInput));
  return ParseConfig(text, format, path, world_size);
}

std::string IgnoredKeysWarning(const LoadedConfig& config) {
  if (config.ignored_keys.empty()) return "";
  return "DeepSpeed config keys not used by Strata (ignored): " + JoinList(config.ignored_keys);
}

std::string OptionsToJson(const EngineOptions& options) {
  return internal::WriteStrata(options).dump(2) + "\n";
}

}  // namespace strata
