// What both config dialects (config_strata.cpp, config_deepspeed.cpp) read with: the reading
// state, a JSON object being read with its path, and typed readers whose errors name the key,
// what was expected and what was found. Private to core/; nlohmann::json stays inside these
// files, and config.cpp catches its exceptions so that none crosses the API.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/core/config.h"
#include "strata/core/status.h"

namespace strata::internal {

using Json = nlohmann::ordered_json;

inline constexpr int64_t kIntMax = std::numeric_limits<int>::max();
inline constexpr int64_t kIntMin = std::numeric_limits<int>::min();
inline constexpr double kInf = std::numeric_limits<double>::infinity();

/// The sections of Strata's format other than "optimizer" (which DeepSpeed also has).
inline constexpr auto kStrataOnlySections =
    std::to_array<std::string_view>({"device", "host", "nvme", "precision", "placement"});

std::string Lower(std::string_view text);
/// "parent.key", or "key" at the top.
std::string JoinPath(std::string_view parent, std::string_view key);
/// Compact JSON text of a value for messages, cut short when long.
std::string Show(const Json& value);
std::string Quote(std::string_view text);
/// Shortest text that reads back as the same double: "0", "0.001", "1e-08".
std::string FormatNumber(double value);
/// "a, b, c".
std::string JoinList(const std::vector<std::string>& items);
bool ContainsKey(std::span<const std::string_view> keys, std::string_view key);

// Values as they appear in "key: auto -> value" notes.
std::string NoteValue(bool v);
std::string NoteValue(int v);
std::string NoteValue(uint64_t v);
std::string NoteValue(double v);
std::string NoteValue(const std::string& v);
std::string NoteValue(Tier v);
std::string NoteValue(DType v);
std::string NoteValue(DeviceKind v);
std::string NoteValue(NvmeBackend v);
std::string NoteValue(OptimizerType v);
std::string NoteValue(const std::vector<std::string>& v);

/// The state of one config being read.
struct Context {
  std::string source;
  bool deepspeed = false;
  /// Full paths of every key that was looked up and present.
  std::set<std::string> consumed;
  /// For each object path, the keys looked up in it (for "known keys" in error messages).
  std::map<std::string, std::vector<std::string>> known;
  std::vector<std::string> auto_resolved;
  int world_size = 1;  ///< Data-parallel ranks (DeepSpeed's batch sizes).
};

/// A JSON object being read, with its path. `json` is null for an absent section: every lookup
/// then finds nothing, so the defaults stand.
class ObjectReader {
 public:
  ObjectReader(Context* ctx, const Json* json, std::string path)
      : ctx_(ctx), json_(json), path_(std::move(path)) {}

  [[nodiscard]] Context& ctx() const { return *ctx_; }
  [[nodiscard]] bool present() const { return json_ != nullptr; }
  [[nodiscard]] std::string PathOf(std::string_view key) const { return JoinPath(path_, key); }

  /// Returns the value of `key` and marks it used, or nullptr when absent (a JSON null counts
  /// as absent in DeepSpeed configs, as in DeepSpeed).
  const Json* Get(std::string_view key);

  /// The error for a value of the wrong type or out of range.
  Status Expected(std::string_view key, std::string_view what, const Json& got) const;

  /// Any other error about `key`.
  Status Error(std::string_view key, std::string_view message) const;

  /// The object under `key`, which may be absent.
  Result<ObjectReader> Child(std::string_view key);

 private:
  Context* ctx_;
  const Json* json_;
  std::string path_;
};

/// Looks up `key`. In a DeepSpeed config the string "auto" means "use the default": then the
/// current value of the field (its default) stays, a note is recorded and nullptr returned.
template <typename T>
const Json* Lookup(ObjectReader& obj, std::string_view key, const T& current) {
  const Json* value = obj.Get(key);
  if (value != nullptr && obj.ctx().deepspeed && value->is_string() &&
      value->get_ref<const std::string&>() == "auto") {
    obj.ctx().auto_resolved.push_back(obj.PathOf(key) + ": auto -> " + NoteValue(current));
    return nullptr;
  }
  return value;
}

// JSON value conversions: false when `v` is no whole number in range.
bool AsInt64(const Json& v, int64_t* out);
bool AsUint64(const Json& v, uint64_t* out);

/// A range of numbers for messages: "a number in [0, 1)", "a number > 0", ...
struct NumberRange {
  double lo = -kInf;
  double hi = kInf;
  bool lo_open = false;
  bool hi_open = false;

  [[nodiscard]] bool Contains(double v) const;
  [[nodiscard]] std::string Describe() const;
};

inline constexpr NumberRange kAnyNumber{};
inline constexpr NumberRange kNonNegative{0, kInf, false, false};
inline constexpr NumberRange kPositive{0, kInf, true, false};
inline constexpr NumberRange kUnitClosed{0, 1, false, false};
inline constexpr NumberRange kUnitHalfOpen{0, 1, false, true};

// Typed readers: absent (or "auto") leaves *out unchanged.
Status ReadBool(ObjectReader& obj, std::string_view key, bool* out);
Status ReadInt(ObjectReader& obj, std::string_view key, int* out, int64_t min = kIntMin,
               int64_t max = kIntMax);
Status ReadNumber(ObjectReader& obj, std::string_view key, double* out,
                  const NumberRange& range = kAnyNumber);
/// An element count (DeepSpeed), a JSON number only.
Status ReadCount(ObjectReader& obj, std::string_view key, uint64_t* out, bool positive);
/// A byte size (Strata): a non-negative whole number, or a string ParseBytes understands.
Status ReadBytes(ObjectReader& obj, std::string_view key, uint64_t* out);
Status ReadString(ObjectReader& obj, std::string_view key, std::string* out);
/// A list of directories: an array of non-empty strings, or one string.
Status ReadPaths(ObjectReader& obj, std::string_view key, std::vector<std::string>* out);

/// An enum spelled as a string, parsed by `parse` (a function returning Result<T>).
template <typename T, typename ParseFn>
Status ReadEnum(ObjectReader& obj, std::string_view key, T* out, ParseFn parse,
                std::string_view choices) {
  const Json* v = Lookup(obj, key, *out);
  if (v == nullptr) return Status::Ok();
  if (v->is_string()) {
    Result<T> parsed = parse(v->get_ref<const std::string&>());
    if (parsed.ok()) {
      *out = *parsed;
      return Status::Ok();
    }
  }
  return obj.Expected(key, "one of " + std::string(choices), *v);
}

/// Keys of `object` (at `path`) that were never looked up, in document order, as
/// (parent path, full path); descends into objects that were read.
void CollectUnused(const Json& object, const std::string& path, const Context& ctx,
                   std::vector<std::pair<std::string, std::string>>* out);

// The dialects.

/// Strata's own format (config_strata.cpp): every field, unknown keys refused.
Status ReadStrata(const Json& doc, Context* ctx, EngineOptions* options);
/// `options` as a document in Strata's format, every field written.
Json WriteStrata(const EngineOptions& options);
/// DeepSpeed's format (config_deepspeed.cpp), onto `loaded`'s options, batch sizes and notes.
Status ReadDeepSpeed(const Json& doc, Context* ctx, LoadedConfig* loaded);
/// OK when the key Strata did not read (`full`, in section `parent`) is one DeepSpeed knows
/// (ignored with a warning); else the error DeepSpeed would give, or a likelier key.
Status CheckDeepSpeedKeyKnown(Context& ctx, const std::string& parent, const std::string& full);

}  // namespace strata::internal
