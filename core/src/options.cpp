#include "strata/core/options.h"

#include <array>
#include <charconv>
#include <cmath>
#include <set>
#include <string>

namespace strata {
namespace {

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

// Shortest text that reads back as the same double ("0.001", "1e-08", "inf").
std::string FormatNumber(double value) {
  std::array<char, 64> buffer{};
  auto [end, ec] = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  if (ec != std::errc()) return std::to_string(value);
  return std::string(buffer.data(), end);
}

std::string Quote(std::string_view text) {
  std::string out = "\"";
  out += text;
  out += '"';
  return out;
}

// Appends " (DeepSpeed: <key>)" when `deepspeed_key` is not empty.
std::string DeepSpeedHint(std::string_view deepspeed_key) {
  if (deepspeed_key.empty()) return "";
  return " (DeepSpeed: " + std::string(deepspeed_key) + ")";
}

// "<field> is <value>; it must be <rule> (DeepSpeed: <key>)".
Status Bad(std::string_view field, const std::string& value, std::string_view rule,
           std::string_view deepspeed_key = "") {
  return InvalidArgument(std::string(field) + " is " + value + "; it must be " + std::string(rule) +
                         DeepSpeedHint(deepspeed_key));
}

bool IsValidTier(Tier tier) {
  return tier == Tier::kDevice || tier == Tier::kHost || tier == Tier::kNvme;
}

std::string TierValue(Tier tier) {
  if (!IsValidTier(tier)) return std::to_string(static_cast<int>(tier));
  return Quote(TierName(tier));
}

Status ValidateDevice(const DeviceOptions& o) {
  if (o.kind != DeviceKind::kHost && o.kind != DeviceKind::kCuda) {
    return Bad("device.kind", std::to_string(static_cast<int>(o.kind)), R"("host" or "cuda")");
  }
  if (o.kind == DeviceKind::kHost && o.host_device_memory_bytes == 0) {
    return Bad("device.host_device_memory_bytes", "0",
               "> 0 when device.kind is \"host\" (it is the HostDevice's memory budget)");
  }
  if (!std::isfinite(o.copy_bandwidth_gbps) || o.copy_bandwidth_gbps < 0) {
    return Bad("device.copy_bandwidth_gbps", FormatNumber(o.copy_bandwidth_gbps),
               "a finite number >= 0 (0 = unthrottled)");
  }
  if (o.cuda_device < 0) {
    return Bad("device.cuda_device", std::to_string(o.cuda_device), ">= 0 (a CUDA device ordinal)");
  }
  return Status::Ok();
}

Status ValidateHost(const HostOptions& o) {
  if (o.optimizer_buffer_count < 0) {
    return Bad("host.optimizer_buffer_count", std::to_string(o.optimizer_buffer_count),
               ">= 1 (staging buffers bound how many chunks are in flight), or 0 for automatic",
               "zero_optimization.offload_optimizer.buffer_count");
  }
  if (o.param_buffer_count < 1) {
    return Bad("host.param_buffer_count", std::to_string(o.param_buffer_count),
               ">= 1 (staging buffers bound how many chunks are in flight)",
               "zero_optimization.offload_param.buffer_count");
  }
  if (o.buffer_size < 4096) {
    return Bad("host.buffer_size", std::to_string(o.buffer_size),
               ">= 4096 bytes (one staging buffer holds at least one 4 KiB I/O block)",
               "zero_optimization.offload_param.buffer_size");
  }
  if (o.pinned_memory_bytes != 0 && o.pinned_memory_bytes < o.buffer_size) {
    return InvalidArgument("host.pinned_memory_bytes is " + std::to_string(o.pinned_memory_bytes) +
                           ", smaller than one staging buffer (host.buffer_size " +
                           std::to_string(o.buffer_size) +
                           "); raise it, set it to 0 (automatic) or lower host.buffer_size");
  }
  return Status::Ok();
}

Status ValidateNvme(const NvmeOptions& o) {
  std::set<std::string_view> seen;
  for (size_t i = 0; i < o.paths.size(); ++i) {
    const std::string field = "nvme.paths[" + std::to_string(i) + "]";
    if (o.paths[i].empty()) {
      return Bad(field, "\"\"", "a directory on an NVMe drive, not empty");
    }
    if (!seen.insert(o.paths[i]).second) {
      return InvalidArgument(field + " is " + Quote(o.paths[i]) +
                             ", which is listed twice; list each directory once");
    }
  }
  // Each request in flight holds a block of pinned memory: past 256MiB a block buys no
  // bandwidth (devices reach their peak at a few MiB) and a queue of them exhausts the host.
  constexpr uint64_t kMaxBlockSize = uint64_t{256} << 20;
  if (o.block_size == 0 || o.block_size % 4096 != 0 || o.block_size > kMaxBlockSize) {
    return Bad("nvme.block_size", std::to_string(o.block_size),
               "a positive multiple of 4096 (the O_DIRECT alignment) up to 268435456 (256MiB), "
               "e.g. 1048576",
               "aio.block_size");
  }
  if (o.queue_depth < 1 || o.queue_depth > 32768) {
    return Bad("nvme.queue_depth", std::to_string(o.queue_depth),
               "in [1, 32768] (io_uring entries)", "aio.queue_depth");
  }
  if (o.thread_count < 1) {
    return Bad("nvme.thread_count", std::to_string(o.thread_count), ">= 1",
               "aio.intra_op_parallelism");
  }
  if (o.backend != NvmeBackend::kAuto && o.backend != NvmeBackend::kIoUring &&
      o.backend != NvmeBackend::kPosix) {
    return Bad("nvme.backend", std::to_string(static_cast<int>(o.backend)),
               R"("auto", "io_uring" or "posix")");
  }
  return Status::Ok();
}

Status ValidateOptimizer(const OptimizerOptions& o) {
  if (o.type != OptimizerType::kAdamW && o.type != OptimizerType::kAdam &&
      o.type != OptimizerType::kAdagrad && o.type != OptimizerType::kLion) {
    return Bad("optimizer.type", std::to_string(static_cast<int>(o.type)),
               R"("adamw", "adam", "adagrad" or "lion")", "optimizer.type");
  }
  if (!std::isfinite(o.lr) || o.lr < 0) {
    return Bad("optimizer.lr", FormatNumber(o.lr), "a finite number >= 0", "optimizer.params.lr");
  }
  if (!(o.beta1 >= 0 && o.beta1 < 1)) {
    return Bad("optimizer.beta1", FormatNumber(o.beta1), "in [0, 1)", "optimizer.params.betas[0]");
  }
  if (!(o.beta2 >= 0 && o.beta2 < 1)) {
    return Bad("optimizer.beta2", FormatNumber(o.beta2), "in [0, 1)", "optimizer.params.betas[1]");
  }
  if (!std::isfinite(o.eps) || o.eps <= 0) {
    return Bad("optimizer.eps", FormatNumber(o.eps), "a finite number > 0", "optimizer.params.eps");
  }
  if (!std::isfinite(o.weight_decay) || o.weight_decay < 0) {
    return Bad("optimizer.weight_decay", FormatNumber(o.weight_decay), "a finite number >= 0",
               "optimizer.params.weight_decay");
  }
  if (!std::isfinite(o.gradient_clipping) || o.gradient_clipping < 0) {
    return Bad("optimizer.gradient_clipping", FormatNumber(o.gradient_clipping),
               "a finite number >= 0 (0 = no clipping)", "gradient_clipping");
  }
  if (o.gradient_accumulation_steps < 1) {
    return Bad("optimizer.gradient_accumulation_steps",
               std::to_string(o.gradient_accumulation_steps), ">= 1",
               "gradient_accumulation_steps");
  }
  if (o.cpu_threads < 0) {
    return Bad("optimizer.cpu_threads", std::to_string(o.cpu_threads),
               ">= 0 (0 = all hardware threads)");
  }
  if (o.delayed_update_from_step < 0) {
    return Bad("optimizer.delayed_update_from_step", std::to_string(o.delayed_update_from_step),
               ">= 0 (the first step whose parameters are delayed)");
  }
  return Status::Ok();
}

Status ValidatePrecision(const PrecisionOptions& o) {
  if (o.working_dtype != DType::kFp32 && o.working_dtype != DType::kFp16 &&
      o.working_dtype != DType::kBf16) {
    return Bad("precision.working_dtype", std::to_string(static_cast<int>(o.working_dtype)),
               R"("fp32", "fp16" or "bf16")");
  }
  if (!std::isfinite(o.loss_scale) || o.loss_scale < 0) {
    return Bad("precision.loss_scale", FormatNumber(o.loss_scale),
               "a finite number >= 0 (0 = dynamic loss scaling)", "fp16.loss_scale");
  }
  if (o.initial_scale_power < 0 || o.initial_scale_power > 126) {
    return Bad("precision.initial_scale_power", std::to_string(o.initial_scale_power),
               "in [0, 126] (2^power must be a finite fp32)", "fp16.initial_scale_power");
  }
  if (o.loss_scale_window < 1) {
    return Bad("precision.loss_scale_window", std::to_string(o.loss_scale_window), ">= 1",
               "fp16.loss_scale_window");
  }
  if (o.hysteresis < 1) {
    return Bad("precision.hysteresis", std::to_string(o.hysteresis), ">= 1", "fp16.hysteresis");
  }
  if (!std::isfinite(o.min_loss_scale) || o.min_loss_scale <= 0) {
    return Bad("precision.min_loss_scale", FormatNumber(o.min_loss_scale), "a finite number > 0",
               "fp16.min_loss_scale");
  }
  if (o.working_dtype == DType::kFp16 && o.loss_scale == 0 &&
      o.min_loss_scale > std::ldexp(1.0, o.initial_scale_power)) {
    return InvalidArgument("precision.min_loss_scale is " + FormatNumber(o.min_loss_scale) +
                           ", above the initial dynamic loss scale 2^" +
                           std::to_string(o.initial_scale_power) +
                           " (precision.initial_scale_power); lower min_loss_scale or raise "
                           "initial_scale_power (DeepSpeed: fp16.min_loss_scale, "
                           "fp16.initial_scale_power)");
  }
  return Status::Ok();
}

Status ValidatePlacement(const PlacementOptions& o) {
  if (o.zero_stage < 0 || o.zero_stage > 3) {
    return Bad("placement.zero_stage", std::to_string(o.zero_stage), "0, 1, 2 or 3",
               "zero_optimization.stage");
  }
  if (!IsValidTier(o.optimizer_states)) {
    return Bad("placement.optimizer_states", TierValue(o.optimizer_states),
               R"("device", "host" or "nvme")", "zero_optimization.offload_optimizer.device");
  }
  if (!IsValidTier(o.params)) {
    return Bad("placement.params", TierValue(o.params), R"("device", "host" or "nvme")",
               "zero_optimization.offload_param.device");
  }
  if (!(o.offload_ratio >= 0 && o.offload_ratio <= 1)) {
    return Bad("placement.offload_ratio", FormatNumber(o.offload_ratio), "in [0, 1]",
               "zero_optimization.offload_optimizer.ratio");
  }
  if (o.chunk_bytes == 0 || o.chunk_bytes % 4096 != 0) {
    return Bad("placement.chunk_bytes", std::to_string(o.chunk_bytes),
               "a positive multiple of 4096, e.g. 67108864 (64MiB)");
  }
  if (o.prefetch_depth < 0) {
    return Bad("placement.prefetch_depth", std::to_string(o.prefetch_depth),
               ">= 0 (0 = no prefetch)");
  }
  if (!(o.collective_timeout_seconds > 0) || !std::isfinite(o.collective_timeout_seconds)) {
    return Bad("placement.collective_timeout_seconds", std::to_string(o.collective_timeout_seconds),
               "a number of seconds > 0, e.g. 600");
  }
  // ZeRO++ quantizes stage 3's collectives, as DeepSpeed's does.
  auto needs_stage_3 = [&](bool on, const std::string& name, const std::string& what) {
    if (!on || o.zero_stage == 3) return Status::Ok();
    return InvalidArgument("placement." + name + " quantizes " + what +
                           " of ZeRO stage 3 (ZeRO++), but placement.zero_stage is " +
                           std::to_string(o.zero_stage) + "; set it to 3 or turn " + name +
                           " off (DeepSpeed: zero_optimization.zero_" + name +
                           ", zero_optimization.stage)");
  };
  STRATA_RETURN_IF_ERROR(
      needs_stage_3(o.quantized_weights, "quantized_weights", "the parameter all-gathers"));
  STRATA_RETURN_IF_ERROR(
      needs_stage_3(o.quantized_gradients, "quantized_gradients", "the gradient reduction"));
  if (o.quantized_gradient_bits != 8 && o.quantized_gradient_bits != 4) {
    return Bad("placement.quantized_gradient_bits", std::to_string(o.quantized_gradient_bits),
               "8 (int8) or 4 (int4)");
  }
  return Status::Ok();
}

}  // namespace

Result<DeviceKind> ParseDeviceKind(std::string_view text) {
  const std::string name = Lower(text);
  if (name == "host" || name == "cpu") return DeviceKind::kHost;
  if (name == "cuda" || name == "gpu") return DeviceKind::kCuda;
  return InvalidArgument("unknown device kind " + Quote(text) + R"(; expected "host" or "cuda")");
}

std::string_view NvmeBackendName(NvmeBackend backend) {
  switch (backend) {
    case NvmeBackend::kAuto: return "auto";
    case NvmeBackend::kIoUring: return "io_uring";
    case NvmeBackend::kPosix: return "posix";
  }
  return "unknown";
}

Result<NvmeBackend> ParseNvmeBackend(std::string_view text) {
  const std::string name = Lower(text);
  if (name == "auto") return NvmeBackend::kAuto;
  if (name == "io_uring" || name == "uring" || name == "iouring") return NvmeBackend::kIoUring;
  if (name == "posix") return NvmeBackend::kPosix;
  return InvalidArgument("unknown NVMe backend " + Quote(text) +
                         R"(; expected "auto", "io_uring" or "posix")");
}

std::string_view OptimizerTypeName(OptimizerType type) {
  switch (type) {
    case OptimizerType::kAdamW: return "adamw";
    case OptimizerType::kAdam: return "adam";
    case OptimizerType::kAdagrad: return "adagrad";
    case OptimizerType::kLion: return "lion";
  }
  return "unknown";
}

Result<OptimizerType> ParseOptimizerType(std::string_view text) {
  const std::string name = Lower(text);
  if (name == "adamw") return OptimizerType::kAdamW;
  if (name == "adam") return OptimizerType::kAdam;
  if (name == "adagrad") return OptimizerType::kAdagrad;
  if (name == "lion") return OptimizerType::kLion;
  return InvalidArgument("unknown optimizer " + Quote(text) +
                         R"(; supported: "adamw", "adam", "adagrad", "lion")");
}

Status EngineOptions::Validate() const {
  STRATA_RETURN_IF_ERROR(ValidateDevice(device));
  STRATA_RETURN_IF_ERROR(ValidateHost(host));
  STRATA_RETURN_IF_ERROR(ValidateNvme(nvme));
  STRATA_RETURN_IF_ERROR(ValidateOptimizer(optimizer));
  STRATA_RETURN_IF_ERROR(ValidatePrecision(precision));
  STRATA_RETURN_IF_ERROR(ValidatePlacement(placement));

  // Combinations.
  if (optimizer.delayed_update && precision.working_dtype == DType::kFp16 &&
      precision.loss_scale == 0.0) {
    return InvalidArgument(
        "optimizer.delayed_update with fp16's dynamic loss scale: the next step's backward "
        "needs a scale that depends on this step's overflow verdict, which a delayed update "
        "gives only during it; use bf16, or a fixed precision.loss_scale (DeepSpeed: "
        "fp16.loss_scale > 0)");
  }
  if (placement.optimizer_states == Tier::kNvme && nvme.paths.empty()) {
    return InvalidArgument(
        "placement.optimizer_states is \"nvme\" but nvme.paths is empty; set nvme.paths "
        "(DeepSpeed: offload_optimizer.nvme_path)");
  }
  if (placement.params == Tier::kNvme && nvme.paths.empty()) {
    return InvalidArgument(
        "placement.params is \"nvme\" but nvme.paths is empty; set nvme.paths "
        "(DeepSpeed: offload_param.nvme_path)");
  }
  if (placement.max_states_in_host > 0 && placement.optimizer_states != Tier::kNvme) {
    return InvalidArgument(
        "placement.max_states_in_host is set but placement.optimizer_states is \"" +
        std::string(TierName(placement.optimizer_states)) +
        "\": it keeps part of NVMe-homed states in host memory, so set optimizer_states to nvme "
        "(or drop it)");
  }
  // The device steps the states it keeps where the parameters are: it needs them resident.
  const bool device_states =
      placement.optimizer_states == Tier::kDevice || placement.offload_ratio < 1.0;
  if (device_states && placement.params != Tier::kDevice) {
    return InvalidArgument(
        "optimizer states kept on the device (placement.optimizer_states \"device\", or "
        "placement.offload_ratio < 1) need the working parameters there too, but "
        "placement.params is \"" +
        std::string(TierName(placement.params)) +
        "\"; set placement.params to \"device\", or offload the optimizer states");
  }
  return Status::Ok();
}

}  // namespace strata
