#include "train_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>

#include "commands.h"
#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/tier.h"

namespace strata::tools {
namespace {

using examples::ByteLmTrainer;
using examples::TrainSettings;
using examples::TrainStepRecord;
using nlohmann::ordered_json;

std::string FormatRate(double bytes, double seconds) {
  return seconds > 0 ? FormatBandwidth(bytes / seconds) : "-";
}

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

}  // namespace

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

}  // namespace strata::tools
