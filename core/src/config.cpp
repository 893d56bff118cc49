// Config loading: Strata's JSON format and DeepSpeed's, onto EngineOptions.
//
// nlohmann::json is used only in this file. Its exceptions are caught here: the parser's to
// report malformed input with its position, and any other as a last-resort Internal error, so
// none crosses the API.
#include "strata/core/config.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "deepspeed_keys.h"
#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/input_file.h"
#include "strata/core/tier.h"

namespace strata {
namespace {

using Json = nlohmann::ordered_json;

constexpr int64_t kIntMax = std::numeric_limits<int>::max();
constexpr int64_t kIntMin = std::numeric_limits<int>::min();
constexpr double kInf = std::numeric_limits<double>::infinity();

// The sections of Strata's format other than "optimizer" (which DeepSpeed also has).
constexpr auto kStrataOnlySections =
    std::to_array<std::string_view>({"device", "host", "nvme", "precision", "placement"});

// Fields of Strata's "optimizer" section that a DeepSpeed "optimizer" never has at its top.
constexpr auto kStrataOptimizerFields = std::to_array<std::string_view>(
    {"lr", "beta1", "beta2", "eps", "weight_decay", "bias_correction", "gradient_clipping",
     "gradient_accumulation_steps", "cpu_threads", "speculative_updates", "delayed_update",
     "delayed_update_from_step"});

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

// --- Reading state -------------------------------------------------------------------------

struct Context {
  std::string source;
  bool deepspeed = false;
  // Full paths of every key that was looked up and present.
  std::set<std::string> consumed;
  // For each object path, the keys looked up in it (for "known keys" in error messages).
  std::map<std::string, std::vector<std::string>> known;
  std::vector<std::string> auto_resolved;
  int world_size = 1;  // Data-parallel ranks (DeepSpeed's batch sizes).
};

// A JSON object being read, with its path. `json` is null for an absent section: every lookup
// then finds nothing, so the defaults stand.
class ObjectReader {
 public:
  ObjectReader(Context* ctx, const Json* json, std::string path)
      : ctx_(ctx), json_(json), path_(std::move(path)) {}

  [[nodiscard]] Context& ctx() const { return *ctx_; }
  [[nodiscard]] bool present() const { return json_ != nullptr; }
  [[nodiscard]] std::string PathOf(std::string_view key) const { return JoinPath(path_, key); }

  // Returns the value of `key` and marks it used, or nullptr when absent (a JSON null counts as
  // absent in DeepSpeed configs, as in DeepSpeed).
  const Json* Get(std::string_view key) {
    auto& known = ctx_->known[path_];
    if (std::find(known.begin(), known.end(), key) == known.end()) known.emplace_back(key);
    if (json_ == nullptr) return nullptr;
    auto it = json_->find(std::string(key));
    if (it == json_->end()) return nullptr;
    ctx_->consumed.insert(PathOf(key));
    if (ctx_->deepspeed && it->is_null()) return nullptr;
    return &*it;
  }

  // The error for a value of the wrong type or out of range.
  Status Expected(std::string_view key, std::string_view what, const Json& got) const {
    return InvalidArgument(ctx_->source + ": " + PathOf(key) + ": expected " + std::string(what) +
                           ", got " + Show(got));
  }

  // Any other error about `key`.
  Status Error(std::string_view key, std::string_view message) const {
    return InvalidArgument(ctx_->source + ": " + PathOf(key) + ": " + std::string(message));
  }

  // The object under `key`, which may be absent.
  Result<ObjectReader> Child(std::string_view key) {
    const Json* value = Get(key);
    if (value != nullptr && !value->is_object()) return Expected(key, "an object", *value);
    return ObjectReader(ctx_, value, PathOf(key));
  }

 private:
  Context* ctx_;
  const Json* json_;
  std::string path_;
};

// Looks up `key`. In a DeepSpeed config the string "auto" means "use the default": then the
// current value of the field (its default) stays, a note is recorded and nullptr returned.
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

// A range of numbers for messages: "a number in [0, 1)", "a number > 0", ...
struct NumberRange {
  double lo = -kInf;
  double hi = kInf;
  bool lo_open = false;
  bool hi_open = false;

  [[nodiscard]] bool Contains(double v) const {
    if (std::isnan(v)) return false;
    if (lo_open ? !(v > lo) : !(v >= lo)) return false;
    if (hi_open ? !(v < hi) : !(v <= hi)) return false;
    return true;
  }
  [[nodiscard]] std::string Describe() const {
    const std::string lo_text = FormatNumber(lo);
    const std::string hi_text = FormatNumber(hi);
    if (lo == -kInf && hi == kInf) return "a number";
    if (hi == kInf) return std::string("a number ") + (lo_open ? "> " : ">= ") + lo_text;
    if (lo == -kInf) return std::string("a number ") + (hi_open ? "< " : "<= ") + hi_text;
    return std::string("a number in ") + (lo_open ? "(" : "[") + lo_text + ", " + hi_text +
           (hi_open ? ")" : "]");
  }
};

constexpr NumberRange kAnyNumber{};
constexpr NumberRange kNonNegative{0, kInf, false, false};
constexpr NumberRange kPositive{0, kInf, true, false};
constexpr NumberRange kUnitClosed{0, 1, false, false};
constexpr NumberRange kUnitHalfOpen{0, 1, false, true};

// --- Typed readers: absent (or "auto") leaves *out unchanged --------------------------------

Status ReadBool(ObjectReader& obj, std::string_view key, bool* out) {
  const Json* v = Lookup(obj, key, *out);
  if (v == nullptr) return Status::Ok();
  if (!v->is_boolean()) return obj.Expected(key, "true or false", *v);
  *out = v->get<bool>();
  return Status::Ok();
}

Status ReadInt(ObjectReader& obj, std::string_view key, int* out, int64_t min = kIntMin,
               int64_t max = kIntMax) {
  const Json* v = Lookup(obj, key, *out);
  if (v == nullptr) return Status::Ok();
  int64_t value = 0;
  if (!AsInt64(*v, &value) || value < min || value > max) {
    return obj.Expected(key, DescribeIntRange(min, max), *v);
  }
  *out = static_cast<int>(value);
  return Status::Ok();
}

Status ReadNumber(ObjectReader& obj, std::string_view key, double* out,
                  const NumberRange& range = kAnyNumber) {
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

// An enum spelled as a string, parsed by `parse` (a function returning Result<T>).
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

// --- Strata's format -----------------------------------------------------------------------

// Reads each field of Strata's format into EngineOptions.
class StrataReader {
 public:
  StrataReader(Context* ctx, const Json* doc) : top_(ctx, doc, "") {}

  Status Begin(std::string_view section) {
    STRATA_ASSIGN_OR_RETURN(ObjectReader child, top_.Child(section));
    section_ = std::make_unique<ObjectReader>(std::move(child));
    return Status::Ok();
  }
  Status Field(std::string_view key, bool& v) { return ReadBool(*section_, key, &v); }
  Status Field(std::string_view key, int& v) { return ReadInt(*section_, key, &v); }
  Status Field(std::string_view key, double& v) { return ReadNumber(*section_, key, &v); }
  Status Field(std::string_view key, uint64_t& v) { return ReadBytes(*section_, key, &v); }
  Status Field(std::string_view key, std::vector<std::string>& v) {
    return ReadPaths(*section_, key, &v);
  }
  Status Field(std::string_view key, DeviceKind& v) {
    return ReadEnum(*section_, key, &v, ParseDeviceKind, R"("host", "cuda")");
  }
  Status Field(std::string_view key, NvmeBackend& v) {
    return ReadEnum(*section_, key, &v, ParseNvmeBackend, R"("auto", "io_uring", "posix")");
  }
  Status Field(std::string_view key, OptimizerType& v) {
    return ReadEnum(*section_, key, &v, ParseOptimizerType,
                    R"("adamw", "adam", "adagrad", "lion")");
  }
  Status Field(std::string_view key, DType& v) {
    return ReadEnum(*section_, key, &v, ParseDType, R"("fp32", "fp16", "bf16")");
  }
  Status Field(std::string_view key, Tier& v) {
    return ReadEnum(*section_, key, &v, ParseTier, R"("device", "host", "nvme")");
  }

 private:
  ObjectReader top_;
  std::unique_ptr<ObjectReader> section_;
};

// Writes each field of EngineOptions into a JSON document in Strata's format.
class StrataWriter {
 public:
  Status Begin(std::string_view section) {
    section_ = &doc_[std::string(section)];
    *section_ = Json::object();
    return Status::Ok();
  }
  Status Field(std::string_view key, bool v) { return Put(key, v); }
  Status Field(std::string_view key, int v) { return Put(key, v); }
  Status Field(std::string_view key, double v) { return Put(key, v); }
  Status Field(std::string_view key, uint64_t v) {
    // A readable size where it reads back exactly ("64MiB"), else the number.
    if (v != 0) {
      std::string text = FormatBytes(v);
      Result<uint64_t> back = ParseBytes(text);
      if (back.ok() && *back == v) return Put(key, Json(std::move(text)));
    }
    return Put(key, v);
  }
  Status Field(std::string_view key, const std::vector<std::string>& v) {
    Json array = Json::array();
    for (const auto& s : v) array.push_back(s);
    return Put(key, std::move(array));
  }
  Status Field(std::string_view key, DeviceKind v) { return Put(key, DeviceKindName(v)); }
  Status Field(std::string_view key, NvmeBackend v) { return Put(key, NvmeBackendName(v)); }
  Status Field(std::string_view key, OptimizerType v) { return Put(key, OptimizerTypeName(v)); }
  Status Field(std::string_view key, DType v) { return Put(key, DTypeName(v)); }
  Status Field(std::string_view key, Tier v) { return Put(key, TierName(v)); }

  [[nodiscard]] const Json& doc() const { return doc_; }

 private:
  Status Put(std::string_view key, Json value) {
    (*section_)[std::string(key)] = std::move(value);
    return Status::Ok();
  }
  Status Put(std::string_view key, std::string_view text) {
    return Put(key, Json(std::string(text)));
  }

  Json doc_ = Json::object();
  Json* section_ = nullptr;
};

// Every field of Strata's format, in order: the single list both reading and writing use.
// `O` is EngineOptions (reading) or const EngineOptions (writing).
template <typename Visitor, typename O>
Status VisitStrataFields(O& o, Visitor& v) {
  STRATA_RETURN_IF_ERROR(v.Begin("device"));
  STRATA_RETURN_IF_ERROR(v.Field("kind", o.device.kind));
  STRATA_RETURN_IF_ERROR(v.Field("host_device_memory_bytes", o.device.host_device_memory_bytes));
  STRATA_RETURN_IF_ERROR(v.Field("cuda_memory_bytes", o.device.cuda_memory_bytes));
  STRATA_RETURN_IF_ERROR(v.Field("copy_bandwidth_gbps", o.device.copy_bandwidth_gbps));
  STRATA_RETURN_IF_ERROR(v.Field("cuda_device", o.device.cuda_device));

  STRATA_RETURN_IF_ERROR(v.Begin("host"));
  STRATA_RETURN_IF_ERROR(v.Field("pinned_memory_bytes", o.host.pinned_memory_bytes));
  STRATA_RETURN_IF_ERROR(v.Field("pin_memory", o.host.pin_memory));
  STRATA_RETURN_IF_ERROR(v.Field("optimizer_buffer_count", o.host.optimizer_buffer_count));
  STRATA_RETURN_IF_ERROR(v.Field("param_buffer_count", o.host.param_buffer_count));
  STRATA_RETURN_IF_ERROR(v.Field("buffer_size", o.host.buffer_size));

  STRATA_RETURN_IF_ERROR(v.Begin("nvme"));
  STRATA_RETURN_IF_ERROR(v.Field("paths", o.nvme.paths));
  STRATA_RETURN_IF_ERROR(v.Field("block_size", o.nvme.block_size));
  STRATA_RETURN_IF_ERROR(v.Field("queue_depth", o.nvme.queue_depth));
  STRATA_RETURN_IF_ERROR(v.Field("thread_count", o.nvme.thread_count));
  STRATA_RETURN_IF_ERROR(v.Field("single_submit", o.nvme.single_submit));
  STRATA_RETURN_IF_ERROR(v.Field("overlap_events", o.nvme.overlap_events));
  STRATA_RETURN_IF_ERROR(v.Field("direct_io", o.nvme.direct_io));
  STRATA_RETURN_IF_ERROR(v.Field("allow_buffered_fallback", o.nvme.allow_buffered_fallback));
  STRATA_RETURN_IF_ERROR(v.Field("checksums", o.nvme.checksums));
  STRATA_RETURN_IF_ERROR(v.Field("backend", o.nvme.backend));

  STRATA_RETURN_IF_ERROR(v.Begin("optimizer"));
  STRATA_RETURN_IF_ERROR(v.Field("type", o.optimizer.type));
  STRATA_RETURN_IF_ERROR(v.Field("lr", o.optimizer.lr));
  STRATA_RETURN_IF_ERROR(v.Field("beta1", o.optimizer.beta1));
  STRATA_RETURN_IF_ERROR(v.Field("beta2", o.optimizer.beta2));
  STRATA_RETURN_IF_ERROR(v.Field("eps", o.optimizer.eps));
  STRATA_RETURN_IF_ERROR(v.Field("weight_decay", o.optimizer.weight_decay));
  STRATA_RETURN_IF_ERROR(v.Field("bias_correction", o.optimizer.bias_correction));
  STRATA_RETURN_IF_ERROR(v.Field("gradient_clipping", o.optimizer.gradient_clipping));
  STRATA_RETURN_IF_ERROR(
      v.Field("gradient_accumulation_steps", o.optimizer.gradient_accumulation_steps));
  STRATA_RETURN_IF_ERROR(v.Field("cpu_threads", o.optimizer.cpu_threads));
  STRATA_RETURN_IF_ERROR(v.Field("speculative_updates", o.optimizer.speculative_updates));
  STRATA_RETURN_IF_ERROR(v.Field("delayed_update", o.optimizer.delayed_update));
  STRATA_RETURN_IF_ERROR(v.Field("delayed_update_from_step", o.optimizer.delayed_update_from_step));

  STRATA_RETURN_IF_ERROR(v.Begin("precision"));
  STRATA_RETURN_IF_ERROR(v.Field("working_dtype", o.precision.working_dtype));
  STRATA_RETURN_IF_ERROR(v.Field("loss_scale", o.precision.loss_scale));
  STRATA_RETURN_IF_ERROR(v.Field("initial_scale_power", o.precision.initial_scale_power));
  STRATA_RETURN_IF_ERROR(v.Field("loss_scale_window", o.precision.loss_scale_window));
  STRATA_RETURN_IF_ERROR(v.Field("hysteresis", o.precision.hysteresis));
  STRATA_RETURN_IF_ERROR(v.Field("min_loss_scale", o.precision.min_loss_scale));

  STRATA_RETURN_IF_ERROR(v.Begin("placement"));
  STRATA_RETURN_IF_ERROR(v.Field("zero_stage", o.placement.zero_stage));
  STRATA_RETURN_IF_ERROR(v.Field("optimizer_states", o.placement.optimizer_states));
  STRATA_RETURN_IF_ERROR(v.Field("offload_ratio", o.placement.offload_ratio));
  STRATA_RETURN_IF_ERROR(v.Field("params", o.placement.params));
  STRATA_RETURN_IF_ERROR(v.Field("max_params_in_host", o.placement.max_params_in_host));
  STRATA_RETURN_IF_ERROR(v.Field("max_states_in_host", o.placement.max_states_in_host));
  STRATA_RETURN_IF_ERROR(v.Field("pipeline_read", o.placement.pipeline_read));
  STRATA_RETURN_IF_ERROR(v.Field("pipeline_write", o.placement.pipeline_write));
  STRATA_RETURN_IF_ERROR(v.Field("chunk_bytes", o.placement.chunk_bytes));
  STRATA_RETURN_IF_ERROR(v.Field("prefetch_depth", o.placement.prefetch_depth));
  STRATA_RETURN_IF_ERROR(
      v.Field("collective_timeout_seconds", o.placement.collective_timeout_seconds));
  STRATA_RETURN_IF_ERROR(v.Field("quantized_weights", o.placement.quantized_weights));
  STRATA_RETURN_IF_ERROR(v.Field("quantized_gradients", o.placement.quantized_gradients));
  STRATA_RETURN_IF_ERROR(v.Field("quantized_gradient_bits", o.placement.quantized_gradient_bits));
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

Status ReadStrata(const Json& doc, Context* ctx, EngineOptions* options) {
  StrataReader reader(ctx, &doc);
  STRATA_RETURN_IF_ERROR(VisitStrataFields(*options, reader));
  std::vector<std::pair<std::string, std::string>> unused;
  CollectUnused(doc, "", *ctx, &unused);
  if (!unused.empty()) {
    const auto& [parent, full] = unused.front();
    std::string message = ctx->source + ": unknown key " + Quote(full) + " in a Strata config";
    const std::vector<std::string>& keys = ctx->known[parent];
    const std::vector<std::string_view> candidates(keys.begin(), keys.end());
    const std::string_view key =
        std::string_view(full).substr(parent.empty() ? 0 : parent.size() + 1);
    if (std::string_view near = internal::NearMiss(key, candidates); !near.empty()) {
      message += " (did you mean " + Quote(JoinPath(parent, near)) + "?)";
    }
    message += "; ";
    if (parent.empty()) {
      message += "the sections are " + JoinList(ctx->known[""]);
      message +=
          " (for a DeepSpeed config, pass --format deepspeed; ConfigFormat::kDeepSpeed "
          "in the C++ API)";
    } else {
      message += "the keys of " + Quote(parent) + " are " + JoinList(ctx->known[parent]);
    }
    return InvalidArgument(std::move(message));
  }
  return Status::Ok();
}

// --- DeepSpeed's format --------------------------------------------------------------------

// DeepSpeed's own defaults for an optimizer's params (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad,
// DeepSpeedCPULion): note weight_decay 0, where torch.optim.AdamW has 0.01.
void SetDeepSpeedOptimizerDefaults(std::string_view type, OptimizerOptions* o) {
  o->lr = type == "adagrad" ? 1e-2 : 1e-3;
  o->eps = type == "adagrad" ? 1e-10 : 1e-8;
  o->beta1 = 0.9;
  o->beta2 = 0.999;
  o->weight_decay = 0.0;
  o->bias_correction = true;
}

Status ReadDeepSpeedOptimizer(ObjectReader& top, OptimizerOptions* o) {
  STRATA_ASSIGN_OR_RETURN(ObjectReader opt, top.Child("optimizer"));
  if (!opt.present()) return Status::Ok();  // The trainer supplies the optimizer settings.

  std::string type_text = "AdamW";
  STRATA_RETURN_IF_ERROR(ReadString(opt, "type", &type_text));
  const std::string type = Lower(type_text);
  if (type != "adam" && type != "adamw" && type != "adagrad" && type != "lion") {
    return opt.Error("type", "unsupported optimizer " + Quote(type_text) +
                                 "; Strata supports Adam, AdamW, Adagrad and Lion");
  }
  SetDeepSpeedOptimizerDefaults(type, o);

  STRATA_ASSIGN_OR_RETURN(ObjectReader params, opt.Child("params"));
  STRATA_RETURN_IF_ERROR(ReadNumber(params, "lr", &o->lr, kNonNegative));
  std::vector<double> betas = {o->beta1, o->beta2};
  if (const Json* v = params.Get("betas"); v != nullptr) {
    if (v->is_string() && v->get_ref<const std::string&>() == "auto") {
      params.ctx().auto_resolved.push_back(params.PathOf("betas") + ": auto -> [" +
                                           NoteValue(o->beta1) + ", " + NoteValue(o->beta2) + "]");
    } else {
      const bool ok = v->is_array() && v->size() == 2 && (*v)[0].is_number() &&
                      (*v)[1].is_number() && kUnitHalfOpen.Contains((*v)[0].get<double>()) &&
                      kUnitHalfOpen.Contains((*v)[1].get<double>());
      if (!ok) return params.Expected("betas", "two numbers in [0, 1), like [0.9, 0.999]", *v);
      o->beta1 = (*v)[0].get<double>();
      o->beta2 = (*v)[1].get<double>();
    }
  }
  STRATA_RETURN_IF_ERROR(ReadNumber(params, "eps", &o->eps, kPositive));
  STRATA_RETURN_IF_ERROR(ReadNumber(params, "weight_decay", &o->weight_decay, kNonNegative));
  STRATA_RETURN_IF_ERROR(ReadBool(params, "bias_correction", &o->bias_correction));

  if (type == "adam" || type == "adamw") {
    bool amsgrad = false;
    STRATA_RETURN_IF_ERROR(ReadBool(params, "amsgrad", &amsgrad));
    if (amsgrad) {
      return params.Error("amsgrad",
                          "AMSGrad is not supported (neither does DeepSpeed's CPU "
                          "Adam); remove it or set it to false");
    }
    // DeepSpeed: "AdamW" is always decoupled; "Adam" is too unless adam_w_mode is false.
    bool adam_w_mode = true;
    STRATA_RETURN_IF_ERROR(ReadBool(params, "adam_w_mode", &adam_w_mode));
    o->type = (type == "adamw" || adam_w_mode) ? OptimizerType::kAdamW : OptimizerType::kAdam;
  } else {
    o->type = type == "adagrad" ? OptimizerType::kAdagrad : OptimizerType::kLion;
  }
  return Status::Ok();
}

// DeepSpeed's offload "device": none | cpu | nvme.
Status ReadOffloadDevice(ObjectReader& obj, Tier* out) {
  const Json* v = Lookup(obj, "device",
                         std::string(*out == Tier::kDevice ? "none"
                                     : *out == Tier::kHost ? "cpu"
                                                           : "nvme"));
  if (v == nullptr) return Status::Ok();
  if (v->is_string()) {
    const std::string name = Lower(v->get_ref<const std::string&>());
    if (name == "none") *out = Tier::kDevice;
    if (name == "cpu") *out = Tier::kHost;
    if (name == "nvme") *out = Tier::kNvme;
    if (name == "none" || name == "cpu" || name == "nvme") return Status::Ok();
  }
  return obj.Expected("device", R"(one of "none", "cpu", "nvme")", *v);
}

void AddPath(const std::string& path, std::vector<std::string>* paths) {
  if (std::find(paths->begin(), paths->end(), path) == paths->end()) paths->push_back(path);
}

// One offload section (offload_optimizer or offload_param); the caller reads the rest.
struct OffloadSection {
  Tier tier = Tier::kDevice;
  std::string nvme_path;
  bool pin_memory = false;
};

Status ReadOffloadCommon(ObjectReader& obj, OffloadSection* s) {
  STRATA_RETURN_IF_ERROR(ReadOffloadDevice(obj, &s->tier));
  if (const Json* v = Lookup(obj, "nvme_path", s->nvme_path); v != nullptr) {
    if (!v->is_string() || v->get_ref<const std::string&>().empty()) {
      return obj.Expected("nvme_path", "a directory on an NVMe drive (a non-empty string)", *v);
    }
    s->nvme_path = v->get<std::string>();
  }
  STRATA_RETURN_IF_ERROR(ReadBool(obj, "pin_memory", &s->pin_memory));
  if (s->tier == Tier::kNvme && s->nvme_path.empty()) {
    return obj.Error("device", "is \"nvme\" but " + obj.PathOf("nvme_path") +
                                   " is not set; set it to a directory on an NVMe drive");
  }
  return Status::Ok();
}

Result<uint64_t> ElementsToBytes(ObjectReader& obj, std::string_view key, uint64_t elements,
                                 DType dtype) {
  const uint64_t size = DTypeSize(dtype);
  if (elements > std::numeric_limits<uint64_t>::max() / size) {
    return obj.Error(key, std::to_string(elements) + " elements of " +
                              std::string(DTypeName(dtype)) + " do not fit in 64 bits of bytes");
  }
  return elements * size;
}

Status ReadDeepSpeedZero(ObjectReader& top, EngineOptions* o) {
  PlacementOptions& placement = o->placement;
  const DType dtype = o->precision.working_dtype;
  // DeepSpeed counts these in elements; defaults 1e8 and 1e9.
  uint64_t param_buffer_elements = 100'000'000;
  uint64_t max_in_cpu_elements = 1'000'000'000;

  OffloadSection optimizer_offload;
  OffloadSection param_offload;
  bool legacy_pin = false;

  if (const Json* z = top.Get("zero_optimization"); z != nullptr && z->is_boolean()) {
    placement.zero_stage = z->get<bool>() ? 1 : 0;  // The deprecated form: true = stage 1.
  } else {
    STRATA_ASSIGN_OR_RETURN(ObjectReader zero, top.Child("zero_optimization"));
    STRATA_RETURN_IF_ERROR(ReadInt(zero, "stage", &placement.zero_stage, 0, 3));
    const int stage = placement.zero_stage;

    // Deprecated spellings of offload, still accepted by DeepSpeed.
    bool cpu_offload = false;
    bool cpu_offload_param = false;
    STRATA_RETURN_IF_ERROR(ReadBool(zero, "cpu_offload", &cpu_offload));
    STRATA_RETURN_IF_ERROR(ReadBool(zero, "cpu_offload_param", &cpu_offload_param));
    STRATA_RETURN_IF_ERROR(ReadBool(zero, "cpu_offload_use_pin_memory", &legacy_pin));
    if (cpu_offload && stage >= 1) optimizer_offload.tier = Tier::kHost;
    if (cpu_offload_param && stage == 3) param_offload.tier = Tier::kHost;

    // DeepSpeed uses offload_optimizer only with ZeRO (stage >= 1) and offload_param only with
    // stage 3; otherwise they are left unread and reported as ignored, as DeepSpeed ignores them.
    if (stage >= 1) {
      STRATA_ASSIGN_OR_RETURN(ObjectReader oo, zero.Child("offload_optimizer"));
      STRATA_RETURN_IF_ERROR(ReadOffloadCommon(oo, &optimizer_offload));
      STRATA_RETURN_IF_ERROR(
          ReadInt(oo, "buffer_count", &o->host.optimizer_buffer_count, 1, kIntMax));
      STRATA_RETURN_IF_ERROR(ReadBool(oo, "pipeline_read", &placement.pipeline_read));
      STRATA_RETURN_IF_ERROR(ReadBool(oo, "pipeline_write", &placement.pipeline_write));
      STRATA_RETURN_IF_ERROR(ReadNumber(oo, "ratio", &placement.offload_ratio, kUnitClosed));
      if (placement.offload_ratio < 1.0 && stage != 3) {
        return oo.Error("ratio", "partial offload (" + FormatNumber(placement.offload_ratio) +
                                     " < 1) needs zero_optimization.stage 3, got " +
                                     std::to_string(stage) + " (DeepSpeed requires the same)");
      }
    }
    if (stage == 3) {
      // ZeRO++: only stage 3's gathers are quantized; at other stages DeepSpeed ignores it.
      STRATA_RETURN_IF_ERROR(
          ReadBool(zero, "zero_quantized_weights", &placement.quantized_weights));
      STRATA_RETURN_IF_ERROR(
          ReadBool(zero, "zero_quantized_gradients", &placement.quantized_gradients));
      STRATA_ASSIGN_OR_RETURN(ObjectReader op, zero.Child("offload_param"));
      STRATA_RETURN_IF_ERROR(ReadOffloadCommon(op, &param_offload));
      STRATA_RETURN_IF_ERROR(ReadInt(op, "buffer_count", &o->host.param_buffer_count, 1, kIntMax));
      STRATA_RETURN_IF_ERROR(ReadCount(op, "buffer_size", &param_buffer_elements, true));
      STRATA_RETURN_IF_ERROR(ReadCount(op, "max_in_cpu", &max_in_cpu_elements, false));
      STRATA_ASSIGN_OR_RETURN(o->host.buffer_size,
                              ElementsToBytes(op, "buffer_size", param_buffer_elements, dtype));
      STRATA_ASSIGN_OR_RETURN(placement.max_params_in_host,
                              ElementsToBytes(op, "max_in_cpu", max_in_cpu_elements, dtype));
    }
  }
  if (placement.zero_stage != 3) {
    // offload_param was not read: still convert DeepSpeed's element defaults.
    o->host.buffer_size = param_buffer_elements * DTypeSize(dtype);
    placement.max_params_in_host = max_in_cpu_elements * DTypeSize(dtype);
  }

  placement.optimizer_states = optimizer_offload.tier;
  placement.params = param_offload.tier;
  // Valid for DeepSpeed (ZeRO-3 streams the parameters while the GPU keeps the optimizer), but
  // Strata's device steps the states it keeps where the parameters stay: refuse it here, in the
  // keys the user wrote, rather than in EngineOptions' names later.
  const bool states_on_device =
      optimizer_offload.tier == Tier::kDevice || placement.offload_ratio < 1.0;
  if (states_on_device && param_offload.tier != Tier::kDevice) {
    const std::string where =
        optimizer_offload.tier == Tier::kDevice
            ? "the optimizer states stay on the GPU (no zero_optimization.offload_optimizer)"
            : "zero_optimization.offload_optimizer.ratio " + FormatNumber(placement.offload_ratio) +
                  " keeps part of them on the GPU";
    return InvalidArgument(
        top.ctx().source + ": zero_optimization.offload_param.device is " +
        Quote(param_offload.tier == Tier::kHost ? "cpu" : "nvme") + " while " + where +
        "; Strata steps GPU-kept optimizer states only with the parameters on the GPU too. "
        "Offload the optimizer as well (offload_optimizer.device \"cpu\" or \"nvme\", ratio "
        "1), or keep the parameters (offload_param.device \"none\")");
  }
  if (optimizer_offload.tier == Tier::kNvme) AddPath(optimizer_offload.nvme_path, &o->nvme.paths);
  if (param_offload.tier == Tier::kNvme) AddPath(param_offload.nvme_path, &o->nvme.paths);
  o->host.pin_memory = legacy_pin ||
                       (optimizer_offload.tier != Tier::kDevice && optimizer_offload.pin_memory) ||
                       (param_offload.tier != Tier::kDevice && param_offload.pin_memory);
  return Status::Ok();
}

Status ReadDeepSpeedAio(ObjectReader& top, NvmeOptions* o) {
  STRATA_ASSIGN_OR_RETURN(ObjectReader aio, top.Child("aio"));
  if (const Json* v = Lookup(aio, "block_size", o->block_size); v != nullptr) {
    uint64_t block = 0;
    if (!AsUint64(*v, &block) || block == 0 || block % 4096 != 0) {
      return aio.Expected("block_size", "a positive multiple of 4096 (bytes), like 1048576", *v);
    }
    o->block_size = block;
  }
  STRATA_RETURN_IF_ERROR(ReadInt(aio, "queue_depth", &o->queue_depth, 1, 32768));
  // "intra_op_parallelism" is the current name of "thread_count".
  int thread_count = 0;
  int intra_op = 0;
  STRATA_RETURN_IF_ERROR(ReadInt(aio, "thread_count", &thread_count, 1, kIntMax));
  STRATA_RETURN_IF_ERROR(ReadInt(aio, "intra_op_parallelism", &intra_op, 1, kIntMax));
  if (thread_count != 0 && intra_op != 0 && thread_count != intra_op) {
    return aio.Error("intra_op_parallelism",
                     std::to_string(intra_op) + " differs from " + aio.PathOf("thread_count") +
                         " " + std::to_string(thread_count) + "; give one of them");
  }
  if (intra_op != 0) o->thread_count = intra_op;
  if (thread_count != 0) o->thread_count = thread_count;
  STRATA_RETURN_IF_ERROR(ReadBool(aio, "single_submit", &o->single_submit));
  STRATA_RETURN_IF_ERROR(ReadBool(aio, "overlap_events", &o->overlap_events));
  return Status::Ok();
}

// A key Strata did not read (`full`, in section `parent`) is fine if DeepSpeed knows it: Strata
// ignores it with a warning. Otherwise it is an error, as in DeepSpeed's checked sections,
// with the likely intended key when it looks like a typo.
Status CheckDeepSpeedKeyKnown(Context& ctx, const std::string& parent, const std::string& full) {
  const std::string_view key =
      std::string_view(full).substr(parent.empty() ? 0 : parent.size() + 1);
  std::optional<std::span<const std::string_view>> known;
  if (parent.empty()) {
    known = internal::DeepSpeedTopLevelKeys();
  } else {
    known = internal::DeepSpeedStrictSectionKeys(parent);
    if (!known) return Status::Ok();  // DeepSpeed does not check this section's keys either.
  }
  if (ContainsKey(*known, key)) return Status::Ok();

  std::string message = ctx.source + ": unknown key " + Quote(full) + " in a DeepSpeed config";
  if (parent.empty() && ContainsKey(kStrataOnlySections, key)) {
    return InvalidArgument(message + ": " + Quote(key) +
                           " is a section of Strata's own format; read this file as a Strata "
                           "config (the automatic detection, or config check --format strata), "
                           "or write its settings in DeepSpeed's keys");
  }
  if (std::string_view near = internal::NearMiss(key, *known); !near.empty()) {
    message += " (did you mean " + Quote(JoinPath(parent, near)) + "?)";
  } else if (!parent.empty() && ContainsKey(internal::DeepSpeedTopLevelKeys(), key)) {
    message += " (" + Quote(key) + " is a top-level section, not part of " + Quote(parent) + ")";
  }
  if (parent.empty()) {
    message +=
        "; DeepSpeed would ignore it, which would leave what it meant to set at its "
        "default";
  } else {
    message += "; DeepSpeed refuses unknown keys in " + Quote(parent) + " too";
    if (const auto used = ctx.known.find(parent); used != ctx.known.end()) {
      message += ". Strata reads " + JoinList(used->second) + " there";
    }
  }
  return InvalidArgument(std::move(message));
}

// DeepSpeed's three batch sizes: the missing ones derived from those given, then the triple
// checked against the world size, with DeepSpeed's rules (runtime/config.py).
Status ReadDeepSpeedBatch(ObjectReader& top, LoadedConfig* loaded, OptimizerOptions* o) {
  constexpr std::string_view kKeys[3] = {"train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps"};
  int given[3] = {0, 0, 0};  // 0: not given, or "auto" (noted below with what it became).
  bool automatic[3] = {false, false, false};
  for (int k = 0; k < 3; ++k) {
    const Json* v = top.Get(kKeys[k]);
    automatic[k] = v != nullptr && v->is_string() && v->get_ref<const std::string&>() == "auto";
    if (!automatic[k]) STRATA_RETURN_IF_ERROR(ReadInt(top, kKeys[k], &given[k], 1, kIntMax));
  }
  auto note_auto = [&](const int64_t(&resolved)[3]) {
    for (int k = 0; k < 3; ++k) {
      if (!automatic[k]) continue;
      top.ctx().auto_resolved.push_back(
          top.PathOf(kKeys[k]) + ": auto -> " +
          (resolved[k] > 0 ? std::to_string(resolved[k]) : std::string("the trainer's")));
    }
  };
  const auto [train, micro, accumulation] = given;
  const int64_t ranks = top.ctx().world_size;
  if (train == 0 && micro == 0) {
    // The trainer picks the batch (DeepSpeed requires one of the two; an engine does not).
    if (accumulation != 0) o->gradient_accumulation_steps = accumulation;
    note_auto({0, 0, o->gradient_accumulation_steps});
    return Status::Ok();
  }
  // micro x accumulation x ranks, or -1 when it does not fit in 64 bits (ints up to 2^31 times
  // ranks up to 2^20 can exceed it).
  auto product = [ranks](int64_t micro_batch, int64_t steps) -> int64_t {
    int64_t p = 0;
    if (__builtin_mul_overflow(micro_batch, steps, &p) || __builtin_mul_overflow(p, ranks, &p)) {
      return -1;
    }
    return p;
  };
  int64_t t = train, m = micro, a = accumulation;
  if (t != 0 && m != 0 && a == 0) {
    a = t / m / ranks;
  } else if (t != 0 && m == 0 && a != 0) {
    m = t / ranks / a;
  } else if (t == 0) {
    a = a == 0 ? 1 : a;
    t = product(m, a);
  } else if (m == 0) {
    a = 1;
    m = t / ranks;
  }
  if (a < 1 || m < 1 || t < 1 || t != product(m, a)) {
    return InvalidArgument(
        top.ctx().source + ": train_batch_size " + std::to_string(t) +
        " is not train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size (" +
        std::to_string(m) + " x " + std::to_string(a) + " x " + std::to_string(ranks) +
        (train != 0 && micro != 0 && accumulation != 0 ? "" : ", the missing ones derived") +
        "); give consistent values, or leave one out for Strata to derive as DeepSpeed does" +
        (ranks == 1 ? " (a config meant for several ranks: strata config check --world-size N "
                      "checks it for N)"
                    : ""));
  }
  loaded->train_batch_size = t;
  loaded->micro_batch_size = m;
  o->gradient_accumulation_steps = int(a);
  note_auto({t, m, a});
  return Status::Ok();
}

Status ReadDeepSpeed(const Json& doc, Context* ctx, LoadedConfig* loaded) {
  EngineOptions* o = &loaded->options;
  ObjectReader top(ctx, &doc, "");

  // What a DeepSpeed config means when a key is absent: no ZeRO, no offload, fp32.
  o->placement.zero_stage = 0;
  o->placement.optimizer_states = Tier::kDevice;
  o->placement.params = Tier::kDevice;

  // Precision first: element counts below are converted with the working dtype's size.
  bool fp16 = false;
  bool bf16 = false;
  {
    STRATA_ASSIGN_OR_RETURN(ObjectReader f, top.Child("fp16"));
    PrecisionOptions& p = o->precision;
    STRATA_RETURN_IF_ERROR(ReadBool(f, "enabled", &fp16));
    STRATA_RETURN_IF_ERROR(ReadNumber(f, "loss_scale", &p.loss_scale, kNonNegative));
    STRATA_RETURN_IF_ERROR(ReadInt(f, "initial_scale_power", &p.initial_scale_power, 0, 126));
    STRATA_RETURN_IF_ERROR(ReadInt(f, "loss_scale_window", &p.loss_scale_window, 1, kIntMax));
    STRATA_RETURN_IF_ERROR(ReadInt(f, "hysteresis", &p.hysteresis, 1, kIntMax));
    STRATA_RETURN_IF_ERROR(ReadNumber(f, "min_loss_scale", &p.min_loss_scale, kPositive));
  }
  for (std::string_view key : {"bf16", "bfloat16"}) {  // "bfloat16" is the older name.
    STRATA_ASSIGN_OR_RETURN(ObjectReader b, top.Child(key));
    bool enabled = false;
    STRATA_RETURN_IF_ERROR(ReadBool(b, "enabled", &enabled));
    bf16 = bf16 || enabled;
  }
  if (fp16 && bf16) {
    return InvalidArgument(ctx->source +
                           ": fp16.enabled and bf16.enabled are both true; enable at most one "
                           "(neither means fp32)");
  }
  o->precision.working_dtype = fp16 ? DType::kFp16 : bf16 ? DType::kBf16 : DType::kFp32;

  STRATA_RETURN_IF_ERROR(ReadDeepSpeedOptimizer(top, &o->optimizer));
  STRATA_RETURN_IF_ERROR(
      ReadNumber(top, "gradient_clipping", &o->optimizer.gradient_clipping, kNonNegative));
  STRATA_RETURN_IF_ERROR(ReadDeepSpeedBatch(top, loaded, &o->optimizer));
  STRATA_RETURN_IF_ERROR(ReadDeepSpeedZero(top, o));
  STRATA_RETURN_IF_ERROR(ReadDeepSpeedAio(top, &o->nvme));
  return Status::Ok();
}

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
  StrataWriter writer;
  VisitStrataFields(options, writer).IgnoreError();  // The writer never fails.
  return writer.doc().dump(2) + "\n";
}

}  // namespace strata
