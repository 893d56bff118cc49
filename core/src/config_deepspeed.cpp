// DeepSpeed's config format onto EngineOptions: its keys, its defaults ("auto" included), its
// batch-size rules and its refusal of unknown keys in the sections it checks.
#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "config_reader.h"
#include "deepspeed_keys.h"
#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/tier.h"

namespace strata::internal {
namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

}  // namespace strata::internal
