// `strata train`: the built-in byte-level language model trained through the offload engine on
// the shipped corpus. Its defaults are the demo: optimizer states on NVMe in a temporary
// folder, parameters offloaded to host memory, and a device budget a fraction of the model.
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "interrupt.h"
#include "metrics_server.h"
#include "scratch_dir.h"
#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/core/host_device.h"
#include "strata/core/log.h"
#include "strata/examples/byte_lm_trainer.h"
#include "strata/offload/mpi_communicator.h"
#include "strata/offload/ranks.h"

namespace strata::tools {
namespace {

using examples::ByteLmTrainer;
using examples::Corpus;
using examples::TrainSettings;
using examples::TrainStepRecord;
using nlohmann::ordered_json;

constexpr const char* kCommand = "strata train";
/// One residual block of the small model (width 128) per chunk.
constexpr uint64_t kDefaultChunkBytes = 288 * kKiB;

/// An integer flag's value when it was not given.
constexpr int64_t kNotGiven = std::numeric_limits<int64_t>::min();

/// Everything the command line asked for; empty/negative/NaN/kNotGiven means "not given".
struct TrainFlags {
  std::string config, model = "small", offload_optimizer, offload_params, nvme_path, device,
                      precision, checkpoint, resume, data = STRATA_CORPUS_PATH,
                      metrics_address = "127.0.0.1";
  int64_t layers = -1, width = -1, context = -1, steps = 150, batch = -1, seq = 128, seed = 1,
          checkpoint_every = 0, metrics_port = kNotGiven, eval_every = 50, zero_stage = -1,
          zero_quantized_gradient_bits = -1;
  uint64_t device_memory = 0, host_memory = 0, chunk_size = 0, max_states_in_host = 0;
  int64_t delayed_update_from = -1;
  double lr = std::numeric_limits<double>::quiet_NaN();
  double collective_timeout = std::numeric_limits<double>::quiet_NaN();
  bool json = false, delayed_update = false, zero_quantized_weights = false,
       zero_quantized_gradients = false;
};

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

/// The engine's options: the config file's (`config`, read and validated by the caller, as
/// `strata config check` reads it), then the flags given over them, then the demo's defaults
/// for what neither said.
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

  // Device budget: given; or, with offloaded parameters, three of the largest chunk's
  // parameters and gradients (a layer's chunks plus one fetched ahead): a fraction of the model;
  // or, with parameters on the device, all of them with room to spare. Chunks as the engine
  // lays them out: padded to shards of equal size across the ranks.
  std::vector<offload::ParameterSpec> specs;
  for (const auto& p : examples::ByteLmParameters(model)) specs.push_back({p.name, p.shape, {}});
  STRATA_ASSIGN_OR_RETURN(offload::ChunkLayout layout,
                          offload::ChunkLayout::Build(specs, o.precision.working_dtype,
                                                      o.placement.chunk_bytes, ranks));
  const uint64_t slot =
      offload::ChunkDeviceBytes(layout.max_chunk_numel(), o.precision.working_dtype);
  if (f.device_memory > 0) {
    o.device.host_device_memory_bytes = f.device_memory;
    o.device.cuda_memory_bytes = f.device_memory;
  } else if (o.placement.params != Tier::kDevice) {
    o.device.host_device_memory_bytes = 3 * slot;
  } else {
    o.device.host_device_memory_bytes =
        2 * layout.total_numel() * (DTypeSize(o.precision.working_dtype) + 12) + 16 * kMiB;
  }
  return o;
}

std::string FormatRate(double bytes, double seconds) {
  return seconds > 0 ? FormatBandwidth(bytes / seconds) : "-";
}

struct RunSummary {
  std::vector<TrainStepRecord> records;
  double validation_loss = 0.0;
  double unigram_entropy = 0.0;
  int ranks = 1;
  /// Peak use of each tier (device, host, NVMe): the largest over the ranks.
  std::array<uint64_t, 3> peak_bytes{};
};

/// Sums over the steps of a run, for the summary table and the JSON document.
struct RunTotals {
  offload::EngineCounters moved;  ///< Bytes per tier pair and CPU optimizer busy time.
  double compute_seconds = 0.0;   ///< Model forward/backward.
  double step_seconds = 0.0;      ///< Wall time of the steps.

  /// Step time over the slowest resource timed in the run (0 when nothing was timed).
  double StepOverSlowest() const {
    const double slowest = std::max(compute_seconds, moved.optimizer_seconds);
    return slowest > 0 ? step_seconds / slowest : 0.0;
  }
};

RunTotals Totals(const std::vector<TrainStepRecord>& records) {
  RunTotals t;
  for (const TrainStepRecord& r : records) {
    t.moved += r.counters;
    t.compute_seconds += r.compute_seconds;
    t.step_seconds += r.seconds;
  }
  return t;
}

/// Chunks by the tier holding their optimizer states ("none": frozen chunks, which have none).
std::map<std::string, size_t> StateChunks(const offload::Engine& engine) {
  std::map<std::string, size_t> chunks;
  for (size_t c = 0; c < engine.chunk_count(); ++c) {
    const std::optional<Tier> tier = engine.placement(c).optimizer_states;
    ++chunks[tier ? std::string(TierName(*tier)) : "none"];
  }
  return chunks;
}

/// Where the optimizer states really are, chunk by chunk: "host", or "host (3 chunks), device
/// (1 chunk)" when offload_optimizer.ratio < 1 split them, or "none (frozen)".
std::string StatesPlacement(const offload::Engine& engine) {
  const std::map<std::string, size_t> chunks = StateChunks(engine);
  auto name = [](const std::string& tier) { return tier == "none" ? tier + " (frozen)" : tier; };
  if (chunks.size() == 1) return name(chunks.begin()->first);
  std::string out;
  for (const auto& [tier, count] : chunks) {
    if (!out.empty()) out += ", ";
    out += name(tier) + " (" + std::to_string(count) + (count == 1 ? " chunk)" : " chunks)");
  }
  return out;
}

ordered_json ToJson(const TrainFlags& f, const TrainSettings& settings,
                    const examples::ByteLmConfig& model, const EngineOptions& o,
                    ByteLmTrainer& trainer, const RunSummary& s) {
  ordered_json j;
  j["model"] = {{"name", f.model},
                {"context", model.context},
                {"width", model.width},
                {"layers", model.layers},
                {"parameters", trainer.parameter_count()}};
  j["placement"] = {
      {"optimizer_states", StatesPlacement(trainer.engine())},
      {"params", TierName(o.placement.params)},
      {"precision", DTypeName(o.precision.working_dtype)},
      {"device_memory_bytes", trainer.engine().tier_usage(Tier::kDevice).budget_bytes},
      {"chunks", trainer.engine().chunk_count()}};
  j["placement"]["optimizer_state_chunks"] = StateChunks(trainer.engine());
  j["optimizer"] = {{"type", OptimizerTypeName(o.optimizer.type)},
                    {"lr", o.optimizer.lr},
                    {"weight_decay", o.optimizer.weight_decay},
                    {"gradient_clipping", o.optimizer.gradient_clipping},
                    {"gradient_accumulation_steps", o.optimizer.gradient_accumulation_steps},
                    {"delayed_update", o.optimizer.delayed_update},
                    {"delayed_update_from_step", o.optimizer.delayed_update_from_step},
                    {"micro_batch", settings.batch},
                    {"seq", settings.seq}};
  ordered_json steps = ordered_json::array();
  for (const TrainStepRecord& r : s.records) {
    steps.push_back({{"step", r.step},
                     {"iteration", r.iteration},
                     {"loss", r.loss},
                     {"skipped", r.skipped},
                     {"rolled_back", r.rolled_back},
                     {"grad_norm", std::isfinite(r.grad_norm) ? ordered_json(r.grad_norm)
                                                              : ordered_json(nullptr)},
                     {"loss_scale", r.loss_scale},
                     {"seconds", r.seconds},
                     {"compute_seconds", r.compute_seconds},
                     {"tokens_per_second", r.tokens_per_second},
                     {"device_to_host_bytes", r.counters.device_to_host_bytes},
                     {"host_to_device_bytes", r.counters.host_to_device_bytes},
                     {"nvme_read_bytes", r.counters.nvme_read_bytes},
                     {"nvme_write_bytes", r.counters.nvme_write_bytes}});
  }
  j["steps"] = std::move(steps);
  const RunTotals t = Totals(s.records);
  const size_t skipped = size_t(std::count_if(s.records.begin(), s.records.end(),
                                              [](const TrainStepRecord& r) { return r.skipped; }));
  const size_t rolled_back = size_t(std::count_if(
      s.records.begin(), s.records.end(), [](const TrainStepRecord& r) { return r.rolled_back; }));
  j["summary"] = {{"steps", s.records.size()},
                  {"skipped_steps", skipped},
                  {"rolled_back_steps", rolled_back},
                  {"train_seconds", t.step_seconds},
                  {"compute_seconds", t.compute_seconds},
                  {"optimizer_seconds", t.moved.optimizer_seconds},
                  {"step_time_over_slowest_resource", t.StepOverSlowest()},
                  {"device_to_host_bytes", t.moved.device_to_host_bytes},
                  {"host_to_device_bytes", t.moved.host_to_device_bytes},
                  {"nvme_read_bytes", t.moved.nvme_read_bytes},
                  {"nvme_write_bytes", t.moved.nvme_write_bytes},
                  // This rank's share of the collectives (ZeRO's Ψ per step: divide by steps).
                  {"reduce_scatter_bytes", t.moved.reduce_scatter_bytes},
                  {"all_gather_bytes", t.moved.all_gather_bytes}};
  j["validation_loss"] = s.validation_loss;
  j["unigram_entropy"] = s.unigram_entropy;
  j["ranks"] = {
      {"world_size", s.ranks},
      {"zero_stage", o.placement.zero_stage},
      {"quantized_weights", o.placement.quantized_weights},
      {"quantized_gradients", o.placement.quantized_gradients},
      {"quantized_gradient_bits", o.placement.quantized_gradient_bits},
      {"peak_bytes",
       {{"device", s.peak_bytes[0]}, {"host", s.peak_bytes[1]}, {"nvme", s.peak_bytes[2]}}}};
  return j;
}

void PrintSummary(const TrainFlags& f, const EngineOptions& o, ByteLmTrainer& trainer,
                  const RunSummary& s) {
  offload::Engine& engine = trainer.engine();
  const RunTotals t = Totals(s.records);
  const offload::EngineCounters& total = t.moved;
  const double step_time = t.step_seconds;
  const uint64_t model_bytes = 2 * trainer.parameter_count() * DTypeSize(o.precision.working_dtype);
  const uint64_t device_budget = engine.tier_usage(Tier::kDevice).budget_bytes;
  std::printf("\nWhere the state lived (%s model: %s params, %zu chunks)\n", f.model.c_str(),
              FormatCount(trainer.parameter_count()).c_str(), engine.chunk_count());
  std::printf("  %-34s %s\n", "fp32 master + Adam moments", StatesPlacement(engine).c_str());
  std::printf("  %-34s %s (%s)\n", "working parameters",
              std::string(TierName(o.placement.params)).c_str(),
              std::string(DTypeName(o.precision.working_dtype)).c_str());
  std::printf("  %-34s %s budget for %s of params + grads (%.1fx)\n", "device memory",
              FormatBytes(device_budget).c_str(), FormatBytes(model_bytes).c_str(),
              double(model_bytes) / double(device_budget));
  for (Tier tier : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    const offload::TierUsage u = engine.tier_usage(tier);
    if (u.budget_bytes == 0) continue;
    std::printf(
        "  %-34s peak %s of %s%s\n", (std::string(TierName(tier)) + " use").c_str(),
        FormatBytes(s.peak_bytes[size_t(tier)]).c_str(), FormatBytes(u.budget_bytes).c_str(),
        s.ranks > 1 ? (" (the largest of " + std::to_string(s.ranks) + " ranks)").c_str() : "");
  }
  std::printf("\nBytes moved (rate over %.1f s of training)\n", step_time);
  auto moved = [&](const char* name, uint64_t bytes) {
    std::printf("  %-34s %12s %14s\n", name, FormatBytes(bytes).c_str(),
                FormatRate(double(bytes), step_time).c_str());
  };
  moved("device -> host (gradients)", total.device_to_host_bytes);
  moved("host -> device (params+zero grads)", total.host_to_device_bytes);
  moved("nvme -> host", total.nvme_read_bytes);
  moved("host -> nvme", total.nvme_write_bytes);
  std::printf("\nTime per resource\n");
  std::printf("  %-34s %10.2f s\n", "steps (wall)", step_time);
  const auto skipped = std::count_if(s.records.begin(), s.records.end(),
                                     [](const TrainStepRecord& r) { return r.skipped; });
  if (skipped > 0) {
    std::printf("  %-34s %10lld of %zu\n", "steps skipped (fp16 overflow)",
                static_cast<long long>(skipped), s.records.size());
  }
  const auto rolled_back = std::count_if(s.records.begin(), s.records.end(),
                                         [](const TrainStepRecord& r) { return r.rolled_back; });
  if (rolled_back > 0) {
    std::printf("  %-34s %10lld of %zu\n", "steps that redid updates (clip)",
                static_cast<long long>(rolled_back), s.records.size());
  }
  std::printf("  %-34s %10.2f s\n", "model forward/backward", t.compute_seconds);
  std::printf("  %-34s %10.2f s\n", "CPU optimizer (busy)", total.optimizer_seconds);
  std::printf("  %-34s %10.2f\n", "step time / slowest resource", t.StepOverSlowest());
  // The unigram entropy is the best a model that ignores context can do: below it, the model
  // has learned to use its context.
  const bool below = s.validation_loss < s.unigram_entropy;
  std::printf("\nValidation loss %.4f nats/byte: %s the corpus' unigram entropy %.4f%s\n",
              s.validation_loss, below ? "below" : "not below", s.unigram_entropy,
              below ? " (the model uses its context)" : "");
}

/// The training loop's own series, next to the engine's in its registry (so one scrape has both).
struct TrainGauges {
  Gauge* step;
  Gauge* loss;
  Gauge* tokens_per_second;
  Gauge* step_seconds;
  Gauge* validation_loss;

  explicit TrainGauges(MetricsRegistry& r)
      : step(&r.GetGauge("strata_train_step", "Optimizer steps taken by strata train.")),
        loss(&r.GetGauge("strata_train_loss", "Training loss of the last step, nats per byte.")),
        tokens_per_second(&r.GetGauge("strata_train_tokens_per_second",
                                      "Bytes of text trained on per second, last step.")),
        step_seconds(
            &r.GetGauge("strata_train_step_wall_seconds", "Wall time of the last training step.")),
        validation_loss(&r.GetGauge("strata_train_validation_loss",
                                    "Last validation loss, nats per byte (0 before any).")) {}
};

/// Serves /metrics (the engine's registry) and /status (JSON) while training runs.
Result<std::unique_ptr<MetricsServer>> ServeMetrics(const TrainFlags& f, offload::Engine& engine,
                                                    const TrainGauges& gauges,
                                                    const EngineOptions& o) {
  MetricsServerOptions options;
  options.address = f.metrics_address;
  options.port = uint16_t(f.metrics_port);
  options.handlers.render_metrics = [&engine] { return engine.metrics().RenderPrometheus(); };
  const std::string model = f.model;
  const int64_t steps = f.steps;
  const std::string states = StatesPlacement(engine);  // Where they are, not what was asked.
  const std::string params(TierName(o.placement.params));
  options.handlers.render_status = [&engine, gauges, model, steps, states, params] {
    ordered_json j;
    j["model"] = model;
    j["step"] = int64_t(gauges.step->Value());
    j["steps"] = steps;
    j["loss"] = gauges.loss->Value();
    j["validation_loss"] = gauges.validation_loss->Value();
    j["tokens_per_second"] = gauges.tokens_per_second->Value();
    j["step_seconds"] = gauges.step_seconds->Value();
    j["placement"] = {{"optimizer_states", states}, {"params", params}};
    ordered_json tiers = ordered_json::object();
    for (Tier tier : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
      const offload::TierUsage u = engine.tier_usage(tier);
      tiers[std::string(TierName(tier))] = {{"budget_bytes", u.budget_bytes},
                                            {"used_bytes", u.used_bytes},
                                            {"peak_bytes", u.peak_bytes}};
    }
    j["tiers"] = std::move(tiers);
    return j.dump() + "\n";
  };
  return MetricsServer::Start(std::move(options));
}

/// Whether `inner` is `outer` or lies under it (both absolute and normal).
bool Within(const std::filesystem::path& inner, const std::filesystem::path& outer) {
  auto [o, i] = std::mismatch(outer.begin(), outer.end(), inner.begin(), inner.end());
  return o == outer.end();
}

/// A checkpoint replaces its folder whole, so it may not hold a swap folder, whose files would
/// only appear once training runs (the save would then refuse the folder after the last step),
/// nor the training corpus (refused anyway as not Strata's; said here in so many words).
/// Checked before anything is created, with links resolved.
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

int Train(const TrainFlags& f) {
  // Started as one of several ranks (mpirun, srun): the ranks train one model, each keeping its
  // shard of the optimizer states (ZeRO stages 1 and 2) and its slice of every batch; rank 0
  // prints, and every rank's errors say which rank it is.
  Result<offload::RankInfo> ranks = offload::DetectRanks();
  if (!ranks.ok()) return Fail(kExitUsage, ranks.status().message(), kCommand);
  const offload::RankInfo launched = *ranks;
  const bool several = launched.size > 1;
  const bool prints = launched.rank == 0;
  auto fail = [&](int code, const std::string& message, const std::string& command = "") {
    return Fail(code,
                several ? "rank " + std::to_string(launched.rank) + " of " +
                              std::to_string(launched.size) + ": " + message
                        : message,
                command);
  };
  if (several && !offload::MpiAvailable()) {
    return fail(kExitFailure, "started by " + launched.launcher +
                                  " as one of several ranks, but this build has no MPI: install "
                                  "Open MPI (libopenmpi-dev) and build again");
  }
  if (f.metrics_port != kNotGiven && (f.metrics_port < 0 || f.metrics_port > 65535)) {
    return fail(kExitUsage,
                "--metrics-port must be in [0, 65535] (0: any free port), got " +
                    std::to_string(f.metrics_port),
                kCommand);
  }
  auto model = ModelConfig(f);
  if (!model.ok()) return fail(kExitUsage, model.status().message(), kCommand);
  if (f.steps < 1 || f.steps > 10'000'000) {
    return fail(kExitUsage, "--steps must be in [1, 10000000]", kCommand);
  }
  if (f.checkpoint_every < 0) return fail(kExitUsage, "--checkpoint-every must be >= 0", kCommand);

  // A config file's content errors exit as `strata config check` does (docs/cli.md's table).
  std::optional<LoadedConfig> config;
  if (!f.config.empty()) {
    // A DeepSpeed config's batch sizes count every rank (train_batch_size).
    Result<LoadedConfig> loaded = LoadConfigFile(f.config, ConfigFormat::kAuto, launched.size);
    if (!loaded.ok()) return fail(kExitFailure, loaded.status().message());
    if (!loaded->ignored_keys.empty()) Log(LogLevel::kWarning, IgnoredKeysWarning(*loaded));
    config = std::move(loaded).value();
  }
  // The micro-batch: --batch, else the config's (DeepSpeed's train_micro_batch_size_per_gpu,
  // given or derived), else 8.
  int64_t batch = f.batch;
  const bool batch_from_config = batch == -1 && config && config->micro_batch_size;
  if (batch == -1) batch = batch_from_config ? *config->micro_batch_size : 8;
  // A config's batch out of what the model takes is the config's error (exit 1, as check's
  // content errors), not the command line's. 65536 is TrainSettings::Validate's limit.
  if (batch_from_config && batch > 65536) {
    return fail(kExitFailure, f.config + ": train_micro_batch_size_per_gpu " +
                                  std::to_string(batch) +
                                  " (given or derived) is more sequences per micro-batch than "
                                  "strata train takes (1 to 65536); lower it, or pass --batch");
  }
  TrainSettings settings{.model = *model,
                         .batch = int(std::clamp<int64_t>(batch, -1, 1 << 30)),
                         .seq = int(std::clamp<int64_t>(f.seq, -1, 1 << 30)),
                         .seed = uint64_t(f.seed)};
  if (Status s = settings.Validate(); !s.ok()) return fail(kExitUsage, s.message(), kCommand);

  auto corpus = Corpus::Load(f.data);
  if (!corpus.ok()) return fail(kExitFailure, corpus.status().message());
  // SIGINT and SIGTERM end the run after the step in flight (interrupt.h); installed before
  // anything is created, so that a signal during teardown ends it at once, not half-way.
  const InterruptHandlers interrupts;
  ScratchDir scratch;
  auto options = EngineOptionsFor(f, config, scratch, *model, launched.size);
  if (!options.ok()) return fail(kExitUsage, options.status().message(), kCommand);
  if (Status s = CheckCheckpointApart(f.checkpoint, options->nvme.paths, f.data); !s.ok()) {
    return fail(kExitFailure, s.message());
  }
  if (options->device.kind == DeviceKind::kCuda) {
    return fail(kExitFailure, examples::kHostComputeOnly);
  }
  auto device =
      CreateHostDevice({.memory_budget_bytes = options->device.host_device_memory_bytes,
                        .copy_bytes_per_second = options->device.copy_bandwidth_gbps * 1e9});
  if (!device.ok()) return fail(kExitFailure, device.status().message());
  // Several ranks: one communicator for the engine's collectives and one for this command's
  // own (the mean loss, the peaks); both run on the MPI thread in the order enqueued.
  offload::EngineEnvironment environment;
  std::unique_ptr<offload::Communicator> scalars;
  if (several) {
    const offload::MpiCommunicatorOptions mpi{.timeout_seconds =
                                                  options->placement.collective_timeout_seconds};
    auto engine_comm = offload::CreateMpiCommunicator(mpi);
    if (!engine_comm.ok()) return fail(kExitFailure, engine_comm.status().message());
    auto own = offload::CreateMpiCommunicator(mpi);
    if (!own.ok()) return fail(kExitFailure, own.status().message());
    if ((*engine_comm)->size() != launched.size) {
      return fail(kExitFailure, "MPI has " + std::to_string((*engine_comm)->size()) +
                                    " ranks, the launcher's variables say " +
                                    std::to_string(launched.size));
    }
    environment.communicator = std::move(*engine_comm);
    scalars = std::move(*own);
    settings.rank = launched.rank;
    settings.ranks = launched.size;
  }
  auto trainer =
      ByteLmTrainer::Create(settings, *options, **device, *corpus, std::move(environment));
  if (!trainer.ok()) return fail(kExitFailure, trainer.status().message());
  offload::Engine& engine = (*trainer)->engine();
  // A run that cannot save fails now, not after its last step.
  if (!f.checkpoint.empty()) {
    if (Status s = engine.CheckSaveTarget(f.checkpoint); !s.ok()) {
      return fail(kExitFailure, "--checkpoint " + f.checkpoint + ": " + s.message());
    }
  }
  if (!f.resume.empty()) {
    if (Status s = engine.Load(f.resume); !s.ok()) {
      return fail(kExitFailure, "resuming from " + f.resume + ": " + s.message());
    }
  }

  const TrainGauges gauges(engine.metrics());
  std::unique_ptr<MetricsServer> server;
  if (f.metrics_port >= 0 && prints) {
    auto started = ServeMetrics(f, engine, gauges, *options);
    if (!started.ok()) return fail(kExitFailure, started.status().message());
    server = std::move(started).value();
    std::fprintf(stderr, "strata train: metrics on http://%s:%u/metrics and /status\n",
                 f.metrics_address.c_str(), unsigned(server->port()));
  }

  RunSummary summary;
  summary.unigram_entropy = corpus->UnigramEntropy();
  summary.ranks = launched.size;
  if (!f.json && prints) {
    std::printf(
        "strata train: %s model, %s params; optimizer states on %s, parameters on %s; "
        "%lld steps of %d x %d x %d bytes (micro-batches x sequences x length); lr %g; loss "
        "scale %g\n",
        f.model.c_str(), FormatCount((*trainer)->parameter_count()).c_str(),
        StatesPlacement(engine).c_str(), std::string(TierName(options->placement.params)).c_str(),
        static_cast<long long>(f.steps), options->optimizer.gradient_accumulation_steps,
        settings.batch, settings.seq, options->optimizer.lr, engine.loss_scale());
  }
  // The signal that stops the run, once every rank knows of it.
  int stop_signal = 0;
  int64_t saved_step = -1;  // The step of the last checkpoint this run saved.
  // Iterations, as DeepSpeed counts them: an fp16 step skipped for overflow is one too, so a run
  // whose every step overflows (a fixed loss scale far too high) still ends.
  // `idle`: no step is running, so a checkpoint or an evaluation may follow.
  auto report = [&](TrainStepRecord r, bool last, bool idle) -> Status {
    const int received = InterruptHandlers::received();
    if (scalars) {
      // The loss of the whole batch: the mean of the ranks' slices; and whether any rank was
      // signalled, so that all stop after this same step.
      std::array<double, 2> sums = {r.loss, received != 0 ? 1.0 : 0.0};
      STRATA_RETURN_IF_ERROR(scalars->AllReduceNow(sums, offload::ReduceOp::kSum)
                                 .WithContext("averaging the loss across ranks"));
      r.loss = sums[0] / launched.size;
      if (sums[1] > 0) stop_signal = received != 0 ? received : SIGTERM;
    } else {
      stop_signal = received;
    }
    summary.records.push_back(r);
    gauges.step->Set(double(r.step));
    gauges.loss->Set(r.loss);
    gauges.tokens_per_second->Set(r.tokens_per_second);
    gauges.step_seconds->Set(r.seconds);
    if (!f.json && prints) {
      std::printf("step %5lld  loss %.4f%s  %8.0f tok/s  %6.3f s  d2h %s  h2d %s  nvme r %s w %s\n",
                  static_cast<long long>(r.step), r.loss, r.skipped ? " (skipped)" : "",
                  r.tokens_per_second, r.seconds,
                  FormatBytes(r.counters.device_to_host_bytes).c_str(),
                  FormatBytes(r.counters.host_to_device_bytes).c_str(),
                  FormatBytes(r.counters.nvme_read_bytes).c_str(),
                  FormatBytes(r.counters.nvme_write_bytes).c_str());
      std::fflush(stdout);
    }
    if (!idle) return Status();
    if (!f.checkpoint.empty() &&
        (last || (f.checkpoint_every > 0 && r.step % f.checkpoint_every == 0 && !r.skipped))) {
      if (Status s = engine.Save(f.checkpoint); !s.ok()) {
        return s.WithContext("saving the checkpoint");
      }
      saved_step = r.step;
    }
    if (!f.json && f.eval_every > 0 && r.step % f.eval_every == 0 && !last) {
      // Every rank evaluates (the same parameters, the same batches): the ranks stay in step,
      // so that rank 0's evaluation does not count against the others' collective timeout.
      STRATA_ASSIGN_OR_RETURN(double loss, (*trainer)->Evaluate());
      gauges.validation_loss->Set(loss);
      if (prints) std::printf("           validation loss %.4f\n", loss);
    }
    return Status();
  };
  // With delayed updates each step is left updating while the next one's forward and backward
  // run, except a step that a checkpoint or an evaluation follows: those need it complete.
  const bool overlap = options->optimizer.delayed_update;
  int64_t iteration = engine.iteration_count();
  bool in_flight = false;  // A delayed update's step started and not yet finished.
  while (iteration < f.steps) {
    // One rank alone may stop at once; several stop as they agreed in `report`.
    if (!several && stop_signal == 0) stop_signal = InterruptHandlers::received();
    if (stop_signal != 0) break;
    const int64_t number = ++iteration;
    const bool last = number >= f.steps;
    const bool pause =
        last ||
        (!f.checkpoint.empty() && f.checkpoint_every > 0 && number % f.checkpoint_every == 0) ||
        (!f.json && f.eval_every > 0 && number % f.eval_every == 0);
    auto before = (*trainer)->StartStep();
    if (!before.ok()) return fail(kExitFailure, before.status().message());
    if (*before) {
      // The step before, completed beside this one: no checkpoint or evaluation falls on it.
      if (Status s = report(**before, /*last=*/false, /*idle=*/false); !s.ok()) {
        return fail(kExitFailure, s.message());
      }
    }
    in_flight = true;
    if (overlap && !pause) continue;
    auto record = (*trainer)->FinishStep();
    in_flight = false;
    if (!record.ok()) return fail(kExitFailure, record.status().message());
    if (Status s = report(*record, last, /*idle=*/true); !s.ok()) {
      return fail(kExitFailure, s.message());
    }
  }
  if (stop_signal != 0) {
    // Finish the step in flight, so that its update is not left half applied, then go.
    if (in_flight) {
      auto record = (*trainer)->FinishStep();
      if (!record.ok()) return fail(kExitFailure, record.status().message());
      if (Status s = report(*record, /*last=*/false, /*idle=*/false); !s.ok()) {
        return fail(kExitFailure, s.message());
      }
    }
    if (prints) {
      const std::string saved = saved_step >= 0 ? "the last checkpoint is " + f.checkpoint +
                                                      " (step " + std::to_string(saved_step) + ")"
                                : f.checkpoint.empty()
                                    ? std::string(
                                          "no checkpoint was saved (--checkpoint DIR "
                                          "--checkpoint-every K keeps progress)")
                                    : "no checkpoint was saved by this run";
      std::fprintf(
          stderr, "strata train: interrupted by %s after step %lld; %s\n", SignalName(stop_signal),
          static_cast<long long>(summary.records.empty() ? 0 : summary.records.back().step),
          saved.c_str());
    }
    // The swap files and the scratch folder go now; under mpirun the ranks then wait for each
    // other, since the launcher ends every rank as soon as one exits.
    server.reset();
    trainer->reset();
    scratch.Remove();
    if (scalars) {
      std::array<double, 1> done = {0.0};
      scalars->AllReduceNow(done, offload::ReduceOp::kSum).IgnoreError();
    }
    return InterruptedExitCode(stop_signal);
  }
  for (Tier tier : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    summary.peak_bytes[size_t(tier)] = engine.tier_usage(tier).peak_bytes;
  }
  if (scalars) {
    std::array<double, 3> peaks;
    for (size_t i = 0; i < peaks.size(); ++i) peaks[i] = double(summary.peak_bytes[i]);
    if (Status s = scalars->AllReduceNow(peaks, offload::ReduceOp::kMax); !s.ok()) {
      return fail(kExitFailure, s.WithContext("gathering the ranks' peaks").message());
    }
    for (size_t i = 0; i < peaks.size(); ++i) summary.peak_bytes[i] = uint64_t(peaks[i]);
  }
  // Every rank evaluates, as during training: with stage 3 each Acquire gathers the chunk's
  // parameters from every rank.
  auto validation = (*trainer)->Evaluate();
  if (!validation.ok()) return fail(kExitFailure, validation.status().message());
  if (!prints) return kExitOk;
  summary.validation_loss = *validation;
  gauges.validation_loss->Set(*validation);
  if (f.json) {
    std::cout << ToJson(f, settings, *model, *options, **trainer, summary).dump(2) << "\n";
  } else {
    PrintSummary(f, *options, **trainer, summary);
  }
  return kExitOk;
}

}  // namespace

int RunTrain(const std::vector<std::string>& args) {
  TrainFlags f;
  FlagParser flags(kCommand,
                   "Train the built-in byte-level language model on the shipped corpus through "
                   "the offload engine (defaults: optimizer states on NVMe in a temporary "
                   "folder, parameters offloaded to host, a device budget of three chunks).");
  flags.AddString("config", &f.config, "FILE", "Strata or DeepSpeed JSON config; flags override");
  flags.AddString("model", &f.model, "NAME", "tiny, small (default) or medium");
  flags.AddInt("layers", &f.layers, "residual blocks (overrides the model's)");
  flags.AddInt("width", &f.width, "model width, a multiple of 8 (overrides the model's)");
  flags.AddInt("context", &f.context, "bytes of context per position (overrides the model's)");
  flags.AddInt("steps", &f.steps,
               "total iterations, counting resumed ones and fp16 steps skipped for overflow, "
               "as DeepSpeed does (default 150)");
  flags.AddInt("batch", &f.batch,
               "sequences per micro-batch (default: the config's "
               "train_micro_batch_size_per_gpu, else 8)");
  flags.AddInt("seq", &f.seq, "bytes predicted per sequence (default 128)");
  flags.AddDouble("lr", &f.lr,
                  "learning rate (default: the config's optimizer section's, else 2e-3)");
  flags.AddString("offload-optimizer", &f.offload_optimizer, "TIER",
                  "optimizer states: device, host or nvme (default nvme)");
  flags.AddString("offload-params", &f.offload_params, "TIER",
                  "working parameters: device, host (default) or nvme");
  flags.AddString("nvme-path", &f.nvme_path, "DIR",
                  "NVMe swap folder (default: a new one under $TMPDIR or /tmp)");
  flags.AddString("device", &f.device, "KIND", "host (default) or cuda");
  flags.AddBytes("device-memory", &f.device_memory,
                 "device memory budget (default: 3 chunks with offloaded parameters)");
  flags.AddBytes("host-memory", &f.host_memory, "pinned host memory budget (default: automatic)");
  flags.AddBytes("max-states-in-host", &f.max_states_in_host,
                 "with --offload-optimizer nvme: this much of the states (the first chunks) in "
                 "host memory instead, the rest on NVMe");
  flags.AddBytes("chunk-size", &f.chunk_size,
                 "working parameters per chunk (default 288KiB: one block of the small model)");
  flags.AddString("precision", &f.precision, "DTYPE", "bf16 (default), fp16 or fp32");
  flags.AddInt("metrics-port", &f.metrics_port,
               "serve Prometheus /metrics and JSON /status on this port while training (0: any)");
  flags.AddString("metrics-address", &f.metrics_address, "ADDR",
                  "interface for --metrics-port (default 127.0.0.1)");
  flags.AddString("checkpoint", &f.checkpoint, "DIR",
                  "save a checkpoint here (at the end); under mpirun or srun every rank saves "
                  "its shards into it, so it must be on a file system the ranks share");
  flags.AddInt("checkpoint-every", &f.checkpoint_every, "also save every K steps");
  flags.AddString("resume", &f.resume, "DIR",
                  "continue from a checkpoint, saved by any number of ranks");
  flags.AddInt("seed", &f.seed, "initialization and data seed (default 1)");
  flags.AddDouble("collective-timeout", &f.collective_timeout,
                  "under mpirun or srun: seconds a collective waits for the other ranks before "
                  "the step fails (placement.collective_timeout_seconds, default 600)");
  flags.AddInt("zero-stage", &f.zero_stage,
               "under mpirun or srun: 1 or 2 shards the optimizer states across the ranks, 3 "
               "the parameters too (each rank keeps its shard in host memory) (default: the "
               "config's, else 2); --batch is per rank");
  flags.AddBool("zero-quantized-weights", &f.zero_quantized_weights,
                "ZeRO++: stage 3 gathers parameters as blockwise int8, about half of bf16's "
                "bytes (zero_optimization.zero_quantized_weights)");
  flags.AddBool("zero-quantized-gradients", &f.zero_quantized_gradients,
                "ZeRO++: stage 3 reduces gradients as blockwise integers, int8 a quarter of "
                "fp32's bytes (zero_optimization.zero_quantized_gradients)");
  flags.AddInt("zero-quantized-gradient-bits", &f.zero_quantized_gradient_bits,
               "width of quantized gradients: 8 (default) or 4, DeepSpeed's qgZ width, an "
               "eighth of fp32's bytes (placement.quantized_gradient_bits)");
  flags.AddInt("eval-every", &f.eval_every, "print the validation loss every K steps (default 50)");
  flags.AddString("data", &f.data, "FILE", "training text (default: the shipped corpus)");
  flags.AddBool("json", &f.json, "print one JSON document instead of progress and a table");
  flags.AddBool("delayed-update", &f.delayed_update,
                "delayed parameter update (ZeRO-Offload's DPU): each step's CPU update runs "
                "beside the next step's forward and backward, which use parameters one update "
                "old (needs --offload-params device)");
  flags.AddInt("delayed-update-from", &f.delayed_update_from,
               "the first step whose update is delayed (default 40)");
  if (Status s = flags.Parse(args); !s.ok()) return Fail(kExitUsage, s.message(), kCommand);
  if (flags.help_requested()) {
    std::cout << flags.Help();
    return kExitOk;
  }
  return Train(f);
}

}  // namespace strata::tools
