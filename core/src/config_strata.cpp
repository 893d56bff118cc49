// Strata's own config format: one list of fields (VisitStrataFields) that both reading and
// writing follow, so that a config written by OptionsToJson reads back as the same options.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config_reader.h"
#include "deepspeed_keys.h"
#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/tier.h"

namespace strata::internal {
namespace {

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
  STRATA_RETURN_IF_ERROR(v.Field("recheck_gradients", o.optimizer.recheck_gradients));
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

}  // namespace

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

Json WriteStrata(const EngineOptions& options) {
  StrataWriter writer;
  VisitStrataFields(options, writer).IgnoreError();  // The writer never fails.
  return writer.doc();
}

}  // namespace strata::internal
