// EngineMetrics: the engine's Prometheus series, registered once and updated lock-free from the
// trainer, the event loop and the stream threads.
//
// What a scrape answers, beyond bytes moved and tier occupancy:
// - what is in flight now: chunk transfers queued or running on each link, and chunk updates in
//   the CPU optimizer (strata_inflight{resource});
// - who waited for what: time the training loop was blocked inside the engine, by what it
//   waited for (strata_trainer_stall_seconds_total{resource}), and time chunk updates spent
//   waiting on each resource of the update pipeline (strata_update_wait_seconds_total{resource});
// - how fast the last step went: bandwidth per tier pair and optimizer parameters per second
//   over the last step, so a dashboard needs no rate() to show them.
#pragma once

#include <chrono>
#include <cstdint>

#include "strata/core/metrics.h"
#include "strata/core/tier.h"

namespace strata::offload {

/// Work that can be in flight, one gauge each.
enum class InFlightKind { kNvmeRead, kNvmeWrite, kHostToDevice, kDeviceToHost, kCpuOptimizer };
inline constexpr int kInFlightKinds = 5;

/// What the training loop waits for when it blocks inside the engine.
enum class TrainerWait {
  kHostToDevice,  ///< Acquire: a host-home chunk's parameters on their way to the device.
  kNvme,          ///< Acquire: an NVMe-home chunk's parameters on their way to the device.
  kDeviceToHost,  ///< Acquire: the chunk's gradients of the previous micro-step still copying out.
  kDeviceMemory,  ///< Acquire: no room in the device budget until a copy in flight finishes.
  kStep,          ///< Step(): the update pipeline after backward, until the step commits.
  kCollective,    ///< Acquire: ZeRO stage 3's all-gather of the chunk's parameters; GradsReady
                  ///< (stages 2 and 3 with accumulation): the chunk's previous micro-step still
                  ///< waiting for its reduce-scatter's buffer.
};
inline constexpr int kTrainerWaits = 6;

/// The collectives whose bytes are counted (strata_collective_bytes_total{op}).
enum class CollectiveKind { kReduceScatter, kAllGather };
inline constexpr int kCollectiveKinds = 2;

/// What a chunk's update waits for.
enum class UpdateWait {
  kNvmeRead,       ///< Its optimizer states arriving from NVMe (from asking for a staging
                   ///< buffer to read them into until they are there).
  kStagingBuffer,  ///< A staging buffer for NVMe-home parameters.
  kCpuOptimizer,   ///< The optimizer step, queued and running.
  kNvmeWrite,      ///< Writing the updated states (and parameters) back.
};
inline constexpr int kUpdateWaits = 4;

struct EngineMetrics {
  Counter* d2h_bytes = nullptr;
  Counter* h2d_bytes = nullptr;
  Counter* nvme_read_bytes = nullptr;
  Counter* nvme_write_bytes = nullptr;
  Counter* optimizer_params = nullptr;
  Counter* device_optimizer_params = nullptr;
  Counter* optimizer_seconds = nullptr;
  Counter* evictions = nullptr;
  Counter* fetches = nullptr;
  // Working-parameter bytes fetched, by the tier they came from: [0] host, [1] NVMe.
  Counter* fetched_bytes[2] = {};
  Counter* steps = nullptr;
  Counter* skipped_steps = nullptr;
  Counter* speculative_updates = nullptr;
  Counter* rolled_back_updates = nullptr;
  Counter* rolled_back_steps = nullptr;
  Counter* changed_gradients = nullptr;
  Gauge* step_seconds = nullptr;
  Gauge* loss_scale = nullptr;
  Gauge* used_bytes[kTierCount] = {};
  Gauge* budget_bytes[kTierCount] = {};
  Gauge* in_flight[kInFlightKinds] = {};
  Counter* trainer_stall[kTrainerWaits] = {};
  Counter* update_wait[kUpdateWaits] = {};
  // Bytes of the whole buffers this rank's collectives covered (a chunk's, for a reduce-scatter
  // or all-gather of it): what the ZeRO paper counts as Ψ per step and stage.
  Counter* collective_bytes[kCollectiveKinds] = {};
  // Over the last step: bytes per second per tier pair (d2h, h2d, nvme->host, host->nvme) and
  // parameters the CPU optimizer updated per second while it was busy (wall time).
  Gauge* bandwidth[4] = {};
  Gauge* optimizer_params_per_second = nullptr;

  /// Registers every series in `registry`, which must outlive this object's use.
  void Register(MetricsRegistry& registry);

  Gauge& in_flight_of(InFlightKind kind) { return *in_flight[int(kind)]; }
  Counter& stall_of(TrainerWait wait) { return *trainer_stall[int(wait)]; }
  Counter& wait_of(UpdateWait wait) { return *update_wait[int(wait)]; }
  Counter& collective_of(CollectiveKind kind) { return *collective_bytes[int(kind)]; }

  /// A chunk update enters / leaves the CPU optimizer: counts it in flight and keeps the wall
  /// time during which at least one chunk was being updated. Loop thread only.
  void OptimizerBegin();
  void OptimizerEnd();

  /// Sets the last-step gauges from the counters' change since the previous call (or, the
  /// first time, since Register). Loop thread only, at each step's end.
  void UpdateRates();

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point last_time_{};
  double last_bytes_[4] = {};
  double last_params_ = 0.0;
  // The CPU optimizer's busy wall time: the union of its chunk updates' intervals.
  int optimizer_running_ = 0;
  Clock::time_point optimizer_busy_since_{};
  double optimizer_wall_seconds_ = 0.0;
  double last_optimizer_wall_seconds_ = 0.0;
};

/// One chunk update in the CPU optimizer for the guard's lifetime (loop thread).
class OptimizerBusyGuard {
 public:
  explicit OptimizerBusyGuard(EngineMetrics& metrics) : metrics_(&metrics) {
    metrics_->OptimizerBegin();
  }
  ~OptimizerBusyGuard() { metrics_->OptimizerEnd(); }
  OptimizerBusyGuard(const OptimizerBusyGuard&) = delete;
  OptimizerBusyGuard& operator=(const OptimizerBusyGuard&) = delete;

 private:
  EngineMetrics* metrics_;
};

/// One operation in flight on a gauge for the guard's lifetime.
class InFlightGuard {
 public:
  explicit InFlightGuard(Gauge& gauge) : gauge_(&gauge) { gauge_->Add(1.0); }
  ~InFlightGuard() { gauge_->Add(-1.0); }
  InFlightGuard(const InFlightGuard&) = delete;
  InFlightGuard& operator=(const InFlightGuard&) = delete;

 private:
  Gauge* gauge_;
};

/// Adds the seconds of its lifetime to a counter when it ends.
class WaitTimer {
 public:
  explicit WaitTimer(Counter& counter)
      : counter_(&counter), start_(std::chrono::steady_clock::now()) {}
  ~WaitTimer() {
    counter_->Increment(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  WaitTimer(const WaitTimer&) = delete;
  WaitTimer& operator=(const WaitTimer&) = delete;

 private:
  Counter* counter_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace strata::offload
