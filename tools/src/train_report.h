// What `strata train` reports: the per-run summary table or JSON document, and the metrics
// endpoint's /status while it trains.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "metrics_server.h"
#include "strata/core/metrics.h"
#include "strata/core/options.h"
#include "strata/examples/byte_lm_trainer.h"
#include "strata/offload/engine.h"
#include "train_flags.h"

namespace strata::tools {

/// What a run leaves for its summary.
struct RunSummary {
  std::vector<examples::TrainStepRecord> records;
  double validation_loss = 0.0;
  double unigram_entropy = 0.0;
  int ranks = 1;
  /// Peak use of each tier (device, host, NVMe): the largest over the ranks.
  std::array<uint64_t, 3> peak_bytes{};
};

/// Where the optimizer states really are, chunk by chunk: "host", or "host (3 chunks), device
/// (1 chunk)" when offload_optimizer.ratio < 1 split them, or "none (frozen)".
std::string StatesPlacement(const offload::Engine& engine);

/// The run as one JSON document (--json).
nlohmann::ordered_json ToJson(const TrainFlags& f, const examples::TrainSettings& settings,
                              const examples::ByteLmConfig& model, const EngineOptions& o,
                              examples::ByteLmTrainer& trainer, const RunSummary& s);

/// The run's tables: where the state lived, the bytes moved, the time per resource and the
/// validation loss against the corpus' unigram entropy.
void PrintSummary(const TrainFlags& f, const EngineOptions& o, examples::ByteLmTrainer& trainer,
                  const RunSummary& s);

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
                                                    const EngineOptions& o);

}  // namespace strata::tools
