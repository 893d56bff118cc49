// The reading state and typed readers both config dialects share (config_reader.h).
#include "config_reader.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <system_error>

#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/tier.h"

namespace strata::internal {

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

std::string JoinPath(std::string_view parent, std::string_view key) {
  if (parent.empty()) return std::string(key);
  std::string out(parent);
  out += '.';
  out += key;
  return out;
}

// Compact JSON text of a value for messages, cut short when long.
std::string Show(const Json& value) {
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  constexpr size_t kMax = 80;
  if (text.size() > kMax) {
    text.resize(kMax);
    text += "...";
  }
  return text;
}

std::string Quote(std::string_view text) { return Show(Json(std::string(text))); }

// Shortest text that reads back as the same double: "0", "0.001", "1e-08".
std::string FormatNumber(double value) {
  std::array<char, 64> buffer{};
  auto [end, ec] = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  if (ec != std::errc()) return std::to_string(value);
  return std::string(buffer.data(), end);
}

// --- Values as they appear in "key: auto -> value" notes -----------------------------------

std::string NoteValue(bool v) { return v ? "true" : "false"; }
std::string NoteValue(int v) { return std::to_string(v); }
std::string NoteValue(uint64_t v) { return std::to_string(v); }
std::string NoteValue(double v) { return Show(Json(v)); }
std::string NoteValue(const std::string& v) { return Quote(v); }
std::string NoteValue(Tier v) { return Quote(TierName(v)); }
std::string NoteValue(DType v) { return Quote(DTypeName(v)); }
std::string NoteValue(DeviceKind v) { return Quote(DeviceKindName(v)); }
std::string NoteValue(NvmeBackend v) { return Quote(NvmeBackendName(v)); }
std::string NoteValue(OptimizerType v) { return Quote(OptimizerTypeName(v)); }
std::string NoteValue(const std::vector<std::string>& v) {
  Json array = Json::array();
  for (const auto& s : v) array.push_back(s);
  return Show(array);
}

const Json* ObjectReader::Get(std::string_view key) {
  auto& known = ctx_->known[path_];
  if (std::find(known.begin(), known.end(), key) == known.end()) known.emplace_back(key);
  if (json_ == nullptr) return nullptr;
  auto it = json_->find(std::string(key));
  if (it == json_->end()) return nullptr;
  ctx_->consumed.insert(PathOf(key));
  if (ctx_->deepspeed && it->is_null()) return nullptr;
  return &*it;
}

Status ObjectReader::Expected(std::string_view key, std::string_view what, const Json& got) const {
  return InvalidArgument(ctx_->source + ": " + PathOf(key) + ": expected " + std::string(what) +
                         ", got " + Show(got));
}

Status ObjectReader::Error(std::string_view key, std::string_view message) const {
  return InvalidArgument(ctx_->source + ": " + PathOf(key) + ": " + std::string(message));
}

Result<ObjectReader> ObjectReader::Child(std::string_view key) {
  const Json* value = Get(key);
  if (value != nullptr && !value->is_object()) return Expected(key, "an object", *value);
  return ObjectReader(ctx_, value, PathOf(key));
}

// --- JSON value conversions ----------------------------------------------------------------

bool AsInt64(const Json& v, int64_t* out) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    *out = v.get<int64_t>();
    return true;
  }
  if (v.is_number_float()) {
    // 1e8 is a float in JSON; accept floats that are whole numbers.
    const double d = v.get<double>();
    if (!std::isfinite(d) || std::trunc(d) != d || std::fabs(d) >= 9.2e18) return false;
    *out = static_cast<int64_t>(d);
    return true;
  }
  return false;
}

bool AsUint64(const Json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer()) {
    const auto i = v.get<int64_t>();
    if (i < 0) return false;
    *out = static_cast<uint64_t>(i);
    return true;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d < 0 || std::trunc(d) != d || d >= 18446744073709551616.0) {
      return false;
    }
    *out = static_cast<uint64_t>(d);
    return true;
  }
  return false;
}

std::string DescribeIntRange(int64_t min, int64_t max) {
  if (min == kIntMin && max == kIntMax) return "an integer";
  if (min == 1 && max == kIntMax) return "a positive integer";
  if (min == 0 && max == kIntMax) return "a non-negative integer";
  return "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

bool NumberRange::Contains(double v) const {
  if (std::isnan(v)) return false;
  if (lo_open ? !(v > lo) : !(v >= lo)) return false;
  if (hi_open ? !(v < hi) : !(v <= hi)) return false;
  return true;
}

std::string NumberRange::Describe() const {
  const std::string lo_text = FormatNumber(lo);
  const std::string hi_text = FormatNumber(hi);
  if (lo == -kInf && hi == kInf) return "a number";
  if (hi == kInf) return std::string("a number ") + (lo_open ? "> " : ">= ") + lo_text;
  if (lo == -kInf) return std::string("a number ") + (hi_open ? "< " : "<= ") + hi_text;
  return std::string("a number in ") + (lo_open ? "(" : "[") + lo_text + ", " + hi_text +
         (hi_open ? ")" : "]");
}

// --- Typed readers: absent (or "auto") leaves *out unchanged --------------------------------

Status ReadBool(ObjectReader& obj, std::string_view key, bool* out) {
  const Json* v = Lookup(obj, key, *out);
  if (v == nullptr) return Status::Ok();
  if (!v->is_boolean()) return obj.Expected(key, "true or false", *v);
  *out = v->get<bool>();
  return Status::Ok();
}

Status ReadInt(ObjectReader& obj, std::string_view key, int* out, int64_t min, int64_t max) {
  const Json* v = Lookup(obj, key, *out);
  if (v == nullptr) return Status::Ok();
  int64_t value = 0;
  if (!AsInt64(*v, &value) || value < min || value > max) {
    return obj.Expected(key, DescribeIntRange(min, max), *v);
  }
  *out = static_cast<int>(value);
  return Status::Ok();
}

Status ReadNumber(ObjectReader& obj, std::string_view key, double* out, const NumberRange& range) {
  const Json* v = Lookup(obj, key, *out);
  if (v == nullptr) return Status::Ok();
  if (!v->is_number() || !range.Contains(v->get<double>())) {
    return obj.Expected(key, range.Describe(), *v);
  }
  *out = v->get<double>();
  return Status::Ok();
}

// An element count (DeepSpeed), a JSON number only.
Status ReadCount(ObjectReader& obj, std::string_view key, uint64_t* out, bool positive) {
  const Json* v = Lookup(obj, key, *out);
  if (v == nullptr) return Status::Ok();
  uint64_t value = 0;
  if (!AsUint64(*v, &value) || (positive && value == 0)) {
    return obj.Expected(key, positive ? "a positive integer" : "a non-negative integer", *v);
  }
  *out = value;
  return Status::Ok();
}

// A byte size (Strata): a non-negative whole number, or a string ParseBytes understands.
Status ReadBytes(ObjectReader& obj, std::string_view key, uint64_t* out) {
  const Json* v = Lookup(obj, key, *out);
  if (v == nullptr) return Status::Ok();
  constexpr std::string_view kWhat =
      "a byte size (a non-negative integer, or a string such as \"64MiB\")";
  if (v->is_string()) {
    Result<uint64_t> parsed = ParseBytes(v->get_ref<const std::string&>());
    if (!parsed.ok()) return obj.Error(key, parsed.status().message());
    *out = *parsed;
    return Status::Ok();
  }
  if (!AsUint64(*v, out)) return obj.Expected(key, kWhat, *v);
  return Status::Ok();
}

Status ReadString(ObjectReader& obj, std::string_view key, std::string* out) {
  const Json* v = Lookup(obj, key, *out);
  if (v == nullptr) return Status::Ok();
  if (!v->is_string()) return obj.Expected(key, "a string", *v);
  *out = v->get<std::string>();
  return Status::Ok();
}

// A list of directories: an array of non-empty strings, or one string.
Status ReadPaths(ObjectReader& obj, std::string_view key, std::vector<std::string>* out) {
  const Json* v = Lookup(obj, key, *out);
  if (v == nullptr) return Status::Ok();
  constexpr std::string_view kWhat = "a directory or a list of directories (non-empty strings)";
  std::vector<std::string> paths;
  if (v->is_string()) {
    paths.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    for (const Json& item : *v) {
      if (!item.is_string()) return obj.Expected(key, kWhat, *v);
      paths.push_back(item.get<std::string>());
    }
  } else {
    return obj.Expected(key, kWhat, *v);
  }
  for (const auto& p : paths) {
    if (p.empty()) return obj.Expected(key, kWhat, *v);
  }
  *out = std::move(paths);
  return Status::Ok();
}

// Keys of `object` (at `path`) that were never looked up, in document order, as
// (parent path, full path); descends into objects that were read.
void CollectUnused(const Json& object, const std::string& path, const Context& ctx,
                   std::vector<std::pair<std::string, std::string>>* out) {
  for (const auto& item : object.items()) {
    std::string full = JoinPath(path, item.key());
    if (ctx.consumed.count(full) == 0) {
      out->emplace_back(path, std::move(full));
    } else if (item.value().is_object()) {
      CollectUnused(item.value(), full, ctx, out);
    }
  }
}

bool ContainsKey(std::span<const std::string_view> keys, std::string_view key) {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

std::string JoinList(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) {
    if (!out.empty()) out += ", ";
    out += item;
  }
  return out;
}

}  // namespace strata::internal
