#include "engine/engine_metrics.h"

#include <string>

namespace strata::offload {
namespace {

constexpr const char* kInFlightNames[kInFlightKinds] = {"nvme_read", "nvme_write", "host_to_device",
                                                        "device_to_host", "cpu_optimizer"};
constexpr const char* kTrainerWaitNames[kTrainerWaits] = {
    "host_to_device", "nvme", "device_to_host", "device_memory", "step", "collective"};
constexpr const char* kCollectiveNames[kCollectiveKinds] = {"reduce_scatter", "all_gather"};
constexpr const char* kUpdateWaitNames[kUpdateWaits] = {"nvme_read", "staging_buffer",
                                                        "cpu_optimizer", "nvme_write"};

}  // namespace

void EngineMetrics::Register(MetricsRegistry& r) {
  const char* moved = "Bytes moved between tiers.";
  const Labels pairs[4] = {
      TierPairLabels(Tier::kDevice, Tier::kHost), TierPairLabels(Tier::kHost, Tier::kDevice),
      TierPairLabels(Tier::kNvme, Tier::kHost), TierPairLabels(Tier::kHost, Tier::kNvme)};
  Counter** byte_counters[4] = {&d2h_bytes, &h2d_bytes, &nvme_read_bytes, &nvme_write_bytes};
  for (int i = 0; i < 4; ++i) {
    *byte_counters[i] = &r.GetCounter("strata_tier_bytes_total", moved, pairs[i]);
    bandwidth[i] =
        &r.GetGauge("strata_tier_bandwidth_bytes_per_second",
                    "Bytes moved per second between tiers since the previous step.", pairs[i]);
  }
  const char* updated = "Parameters updated by the optimizer.";
  optimizer_params = &r.GetCounter("strata_optimizer_params_total", updated, {{"where", "cpu"}});
  device_optimizer_params =
      &r.GetCounter("strata_optimizer_params_total", updated, {{"where", "device"}});
  optimizer_seconds = &r.GetCounter("strata_optimizer_busy_seconds_total",
                                    "Time the CPU optimizer spent updating chunks.");
  optimizer_params_per_second =
      &r.GetGauge("strata_optimizer_params_per_second",
                  "Parameters the CPU optimizer updated per second while busy, last step.");
  evictions = &r.GetCounter("strata_param_evictions_total",
                            "Offloaded parameter chunks dropped from the device.");
  fetches = &r.GetCounter("strata_param_fetches_total",
                          "Offloaded parameter chunks brought to the device.");
  for (Tier from : {Tier::kHost, Tier::kNvme}) {
    fetched_bytes[from == Tier::kNvme] =
        &r.GetCounter("strata_param_fetch_bytes_total",
                      "Working-parameter bytes of offloaded chunks brought to the device, by the "
                      "tier they came from.",
                      {{"from", std::string(TierName(from))}});
  }
  steps = &r.GetCounter("strata_steps_total", "Optimizer steps taken.");
  skipped_steps =
      &r.GetCounter("strata_skipped_steps_total", "Steps skipped for fp16 gradient overflow.");
  speculative_updates = &r.GetCounter(
      "strata_speculative_updates_total",
      "Chunk updates run ahead of a clipped or fp16 step's global norm, as if it were neither.");
  rolled_back_updates = &r.GetCounter(
      "strata_rolled_back_updates_total",
      "Speculative chunk updates rolled back because the step clipped or overflowed, its "
      "gradients changed after they were declared, or it was abandoned.");
  changed_gradients =
      &r.GetCounter("strata_changed_gradients_total",
                    "Chunks whose gradients the trainer changed between declaring them and Step() "
                    "(optimizer.recheck_gradients): their updates used the gradients at Step().");
  rolled_back_steps = &r.GetCounter("strata_rolled_back_steps_total",
                                    "Steps whose speculative updates were rolled back.");
  step_seconds = &r.GetGauge("strata_step_seconds", "Duration of the last optimizer step.");
  loss_scale = &r.GetGauge("strata_loss_scale", "Loss scale for the next backward.");
  for (int t = 0; t < kTierCount; ++t) {
    const Labels tier = {{"tier", std::string(TierName(static_cast<Tier>(t)))}};
    used_bytes[t] = &r.GetGauge("strata_tier_used_bytes", "Bytes in use per tier.", tier);
    budget_bytes[t] = &r.GetGauge("strata_tier_budget_bytes", "Budget per tier.", tier);
  }
  for (int i = 0; i < kInFlightKinds; ++i) {
    in_flight[i] = &r.GetGauge("strata_inflight",
                               "Chunk transfers queued or running per link, and chunk updates in "
                               "the CPU optimizer, now.",
                               {{"resource", kInFlightNames[i]}});
  }
  for (int i = 0; i < kTrainerWaits; ++i) {
    trainer_stall[i] = &r.GetCounter(
        "strata_trainer_stall_seconds_total",
        "Time the training loop was blocked in the engine, by what it waited for (step: the "
        "update pipeline after backward).",
        {{"resource", kTrainerWaitNames[i]}});
  }
  for (int i = 0; i < kUpdateWaits; ++i) {
    update_wait[i] = &r.GetCounter(
        "strata_update_wait_seconds_total",
        "Time chunk updates spent waiting on each resource, summed over concurrent updates.",
        {{"resource", kUpdateWaitNames[i]}});
  }
  for (int i = 0; i < kCollectiveKinds; ++i) {
    collective_bytes[i] = &r.GetCounter(
        "strata_collective_bytes_total",
        "Bytes of the buffers this rank's collectives covered across ranks (a chunk's gradients "
        "reduce-scattered, its parameters all-gathered).",
        {{"op", kCollectiveNames[i]}});
  }
  last_time_ = Clock::now();
}

void EngineMetrics::OptimizerBegin() {
  in_flight_of(InFlightKind::kCpuOptimizer).Add(1.0);
  if (optimizer_running_++ == 0) optimizer_busy_since_ = Clock::now();
}

void EngineMetrics::OptimizerEnd() {
  in_flight_of(InFlightKind::kCpuOptimizer).Add(-1.0);
  if (--optimizer_running_ == 0) {
    optimizer_wall_seconds_ +=
        std::chrono::duration<double>(Clock::now() - optimizer_busy_since_).count();
  }
}

void EngineMetrics::UpdateRates() {
  const Clock::time_point now = Clock::now();
  const double seconds = std::chrono::duration<double>(now - last_time_).count();
  const Counter* byte_counters[4] = {d2h_bytes, h2d_bytes, nvme_read_bytes, nvme_write_bytes};
  for (int i = 0; i < 4; ++i) {
    const double bytes = byte_counters[i]->Value();
    if (seconds > 0) bandwidth[i]->Set((bytes - last_bytes_[i]) / seconds);
    last_bytes_[i] = bytes;
  }
  const double params = optimizer_params->Value() - last_params_;
  const double busy = optimizer_wall_seconds_ - last_optimizer_wall_seconds_;
  optimizer_params_per_second->Set(params > 0 && busy > 0 ? params / busy : 0.0);
  last_params_ = optimizer_params->Value();
  last_optimizer_wall_seconds_ = optimizer_wall_seconds_;
  last_time_ = now;
}

}  // namespace strata::offload
