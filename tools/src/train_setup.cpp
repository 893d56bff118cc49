#include "train_setup.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <system_error>

#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/tier.h"
#include "strata/offload/chunk_layout.h"
#include "strata/offload/device_sizing.h"

namespace strata::tools {
namespace {

/// One residual block of the small model (width 128) per chunk.
constexpr uint64_t kDefaultChunkBytes = 288 * kKiB;

/// Whether `inner` is `outer` or lies under it (both absolute and normal).
bool Within(const std::filesystem::path& inner, const std::filesystem::path& outer) {
  auto [o, i] = std::mismatch(outer.begin(), outer.end(), inner.begin(), inner.end());
  return o == outer.end();
}

}  // namespace

Result<examples::ByteLmConfig> ModelConfig(const TrainFlags& f) {
  examples::ByteLmConfig config;
  if (f.model == "tiny") {
    config = {.context = 4, .width = 64, .layers = 2};
  } else if (f.model == "small") {
    config = {.context = 4, .width = 128, .layers = 10};
  } else if (f.model == "medium") {
    config = {.context = 6, .width = 384, .layers = 8};
  } else {
    return InvalidArgument("unknown model \"" + f.model + "\"; choose tiny, small or medium");
  }
  if (f.layers >= 0) config.layers = int(std::min<int64_t>(f.layers, 1 << 20));
  if (f.width >= 0) config.width = int(std::min<int64_t>(f.width, 1 << 20));
  if (f.context >= 0) config.context = int(std::min<int64_t>(f.context, 1 << 20));
  STRATA_RETURN_IF_ERROR(config.Validate());
  return config;
}

Result<EngineOptions> EngineOptionsFor(const TrainFlags& f,
                                       const std::optional<LoadedConfig>& config,
                                       ScratchDir& scratch, const examples::ByteLmConfig& model,
                                       int ranks) {
  EngineOptions o;
  o.optimizer.lr = 2e-3;
  o.optimizer.weight_decay = 0.0;
  o.placement.optimizer_states = Tier::kNvme;
  o.placement.params = Tier::kHost;
  o.placement.chunk_bytes = kDefaultChunkBytes;
  if (config) {
    const EngineOptions own = o;
    o = config->options;
    if (!config->has_optimizer) {  // The optimizer is the trainer's, as in DeepSpeed.
      o.optimizer.lr = own.optimizer.lr;
      o.optimizer.weight_decay = own.optimizer.weight_decay;
    }
    // The engine's 64MiB default would put the whole built-in model in one chunk, and no
    // chunk's update could overlap another's backward.
    if (!config->has_chunk_bytes) o.placement.chunk_bytes = own.placement.chunk_bytes;
  }
  if (!std::isnan(f.lr)) o.optimizer.lr = f.lr;
  if (!f.offload_optimizer.empty()) {
    STRATA_ASSIGN_OR_RETURN(o.placement.optimizer_states, ParseTier(f.offload_optimizer));
  }
  if (f.zero_stage >= 0) o.placement.zero_stage = int(std::min<int64_t>(f.zero_stage, 1 << 30));
  if (f.zero_quantized_weights) o.placement.quantized_weights = true;
  if (f.zero_quantized_gradients) o.placement.quantized_gradients = true;
  if (f.zero_quantized_gradient_bits != -1) {  // Validation refuses widths other than 8 and 4.
    o.placement.quantized_gradient_bits =
        int(std::clamp<int64_t>(f.zero_quantized_gradient_bits, std::numeric_limits<int>::min(),
                                std::numeric_limits<int>::max()));
  }
  // Several ranks shard the optimizer states (ZeRO stages 1 and 2), which keeps the working
  // parameters on each rank's device, or the parameters too (stage 3), each rank keeping its
  // shard in host memory: those are their defaults there.
  if (ranks > 1 && !config) {
    o.placement.params = o.placement.zero_stage == 3 ? Tier::kHost : Tier::kDevice;
  }
  if (!f.offload_params.empty()) {
    STRATA_ASSIGN_OR_RETURN(o.placement.params, ParseTier(f.offload_params));
  }
  if (!f.precision.empty()) {
    STRATA_ASSIGN_OR_RETURN(o.precision.working_dtype, ParseDType(f.precision));
  }
  if (!f.device.empty()) {
    STRATA_ASSIGN_OR_RETURN(o.device.kind, ParseDeviceKind(f.device));
  }
  if (f.host_memory > 0) o.host.pinned_memory_bytes = f.host_memory;
  if (f.max_states_in_host > 0) o.placement.max_states_in_host = f.max_states_in_host;
  if (f.chunk_size > 0) o.placement.chunk_bytes = f.chunk_size;
  if (f.delayed_update) o.optimizer.delayed_update = true;
  if (f.delayed_update_from >= 0) {
    if (!o.optimizer.delayed_update) {
      return InvalidArgument("--delayed-update-from is a setting of --delayed-update");
    }
    o.optimizer.delayed_update_from_step = int(std::min<int64_t>(f.delayed_update_from, 1 << 30));
  }
  if (!f.nvme_path.empty()) o.nvme.paths = {f.nvme_path};
  if (!std::isnan(f.collective_timeout)) {
    o.placement.collective_timeout_seconds = f.collective_timeout;
  }
  const bool uses_nvme =
      o.placement.optimizer_states == Tier::kNvme || o.placement.params == Tier::kNvme;
  if (uses_nvme && o.nvme.paths.empty()) {
    STRATA_ASSIGN_OR_RETURN(std::string dir, scratch.Make("strata-train"));
    o.nvme.paths = {dir};
  }
  STRATA_RETURN_IF_ERROR(o.Validate());

  // Device budget: given, or sized to the placement (offload/device_sizing.h): with offloaded
  // parameters a fraction of the model, with parameters on the device all of them. Chunks as
  // the engine lays them out: padded to shards of equal size across the ranks.
  std::vector<offload::ParameterSpec> specs;
  for (const auto& p : examples::ByteLmParameters(model)) specs.push_back({p.name, p.shape, {}});
  STRATA_ASSIGN_OR_RETURN(
      const uint64_t fitted,
      offload::DeviceBytesToFit(o, specs, offload::DeviceFit::kPlacement, ranks));
  o.device.host_device_memory_bytes = f.device_memory > 0 ? f.device_memory : fitted;
  if (f.device_memory > 0) o.device.cuda_memory_bytes = f.device_memory;
  return o;
}

Status CheckCheckpointApart(const std::string& checkpoint, const std::vector<std::string>& nvme,
                            const std::string& data) {
  if (checkpoint.empty()) return Status();
  namespace fs = std::filesystem;
  auto resolve = [](const std::string& path) {
    std::error_code ec;
    fs::path resolved = fs::weakly_canonical(fs::absolute(path, ec), ec);
    return (ec ? fs::absolute(path, ec) : resolved).lexically_normal();
  };
  const fs::path dir = resolve(checkpoint);
  for (const std::string& path : nvme) {
    if (Within(resolve(path), dir)) {
      return InvalidArgument("--checkpoint " + checkpoint + " holds the nvme path " + path +
                             ": a checkpoint replaces its folder whole, and the swap files are "
                             "not part of it; give the swap files a folder of their own");
    }
  }
  if (Within(resolve(data), dir)) {
    return InvalidArgument("--checkpoint " + checkpoint + " holds the training corpus " + data +
                           ": a checkpoint replaces its folder whole; save it elsewhere");
  }
  return Status();
}

}  // namespace strata::tools
