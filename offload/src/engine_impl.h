// Engine::Impl: the state behind the public Engine, shared by engine*.cpp.
//
// Threads: the trainer thread (Acquire, Release, GradsReady, Step, Save, Load), the event loop
// thread (every coroutine: gradient arrival, chunk updates, fetches, the step's commit), the
// device's stream threads (host functions), the I/O thread and the optimizer's TBB workers.
// `mutex_` guards what the trainer and the loop both touch (residency, pins, gradients in
// flight, micro-step counts); `cv_` signals its changes to a waiting trainer. The step's own
// bookkeeping (StepState) is touched by the loop thread only.
#pragma once

#include <tbb/task_arena.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <vector>

#include "engine_metrics.h"
#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"
#include "strata/core/event_loop.h"
#include "strata/core/staging_pool.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "strata/nvme/async_io.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_space.h"
#include "strata/offload/engine.h"
#include "strata/offload/loss_scaler.h"

namespace strata::offload {

/// A counting semaphore for coroutines on one event loop. Not thread-safe: every call must come
/// from the loop thread (which is where coroutines run).
class LoopSemaphore {
 public:
  explicit LoopSemaphore(size_t count) : count_(count) {}

  /// Completes when a unit is taken.
  Awaitable<void> Acquire();
  /// Returns a unit, resuming the longest waiter if any.
  void Release();

 private:
  size_t count_;
  std::deque<std::function<void()>> waiters_;
};

/// A StagingPool for coroutines on one event loop: Acquire waits, without blocking the loop,
/// until a buffer is free. Loop thread only, like LoopSemaphore.
class LoopStagingPool {
 public:
  explicit LoopStagingPool(std::unique_ptr<StagingPool> pool)
      : pool_(std::move(pool)), free_(pool_->buffer_count()) {}

  Awaitable<StagingBuffer> Acquire();
  /// Returns `buffer` (if it holds one) and wakes the longest waiter.
  void Release(StagingBuffer& buffer);
  const StagingPool& pool() const { return *pool_; }

 private:
  std::unique_ptr<StagingPool> pool_;
  LoopSemaphore free_;  // Counts the pool's free buffers.
};

struct Chunk {
  size_t numel = 0;
  ChunkPlacement placement;

  // Device: working parameters and their gradient buffer. Always there for device-home
  // parameters; for offloaded ones only while resident (then `device_slot` holds the budget).
  DeviceBuffer params;
  DeviceBuffer grads;
  BudgetReservation device_slot;
  DeviceEvent released;  // Recorded on the compute stream at Release: the trainer's last use.
  bool resident = false;
  bool fetching = false;
  bool stale_fetch = false;  // A step committed while it was fetching: drop what arrives.
  Status fetch_status;
  int pins = 0;
  uint64_t last_use = 0;
  bool grads_in_flight = false;  // Gradients are being copied out (or accumulated).

  // Host.
  AlignedBuffer grads_landing;  // The working-dtype gradients copied out of the device.
  AlignedBuffer grads_sum;      // fp32 sum over micro-steps (gradient_accumulation_steps > 1).
  AlignedBuffer param_copy;     // New working parameters (device- and host-home parameters).
  AlignedBuffer host_params;    // Host-home working parameters.
  AlignedBuffer host_states;    // Host-home optimizer states.

  // Device-home optimizer states (and their fp32 gradient sum for accumulation).
  DeviceBuffer device_states;
  DeviceBuffer device_grads_sum;

  // NVMe: current and shadow extents; a step writes the shadow, its commit flips `current`.
  nvme::ExtentId state_extents[2];
  nvme::ExtentId param_extents[2];
  int state_current = 0;
  int param_current = 0;

  // States read ahead from NVMe for the next update (loop thread). `ready` is released once
  // the read is done; the update then takes `buffer` over.
  struct Preload {
    bool active = false;
    Status status;
    StagingBuffer buffer;
    std::optional<LoopSemaphore> ready;
  } preload;

  // This step. `micro_steps` counts GradsReady calls (trainer thread, under mutex_);
  // `micro_steps_landed` counts gradients that reached the host (loop thread).
  int micro_steps = 0;
  int micro_steps_landed = 0;
  cpu_adam::GradientStats stats;
  Status land_status;    // Failure while summing or measuring the gradients.
  bool arrived = false;  // Every micro-step landed and stats are in (loop thread).
  bool updated = false;  // This step's update is done and waits for the commit (loop thread).
  bool updating = false;

  bool params_offloaded() const { return placement.params != Tier::kDevice; }
  /// Frees the device copy of offloaded parameters (and gradients) and its budget.
  void DropDeviceCopy() {
    params = DeviceBuffer();
    grads = DeviceBuffer();
    device_slot.Reset();
    resident = false;
  }
  size_t working_bytes(size_t element_bytes) const { return numel * element_bytes; }
  size_t device_slot_bytes(DType working_dtype) const {
    return ChunkDeviceBytes(numel, working_dtype);
  }
  size_t state_bytes() const { return ChunkStateBytes(numel); }
};

/// The step in progress (loop thread only).
struct StepState {
  bool requested = false;  // Step() was called and waits for its future.
  std::optional<std::promise<Result<StepReport>>> promise;
  std::chrono::steady_clock::time_point started;
  size_t chunks_arrived = 0;
  bool decided = false;  // Gated steps: the global norm/overflow decision is made.
  bool skip = false;     // fp16 overflow.
  double grad_scale = 1.0;
  double grad_norm = 0.0;
  size_t updates_running = 0;
  Status error;  // First failure of this attempt.
  bool committing = false;
};

class Engine::Impl {
 public:
  Impl(const EngineOptions& options, Device& device, ChunkLayout layout,
       EngineEnvironment environment);
  ~Impl();

  // engine.cpp: creation and placement.
  Status Initialize(std::span<const ParameterSpec> parameters);

  // engine_params.cpp: parameter residency for forward/backward.
  Result<ChunkView> Acquire(size_t chunk);
  void Release(size_t chunk);

  // engine_step.cpp: gradients and the step pipelines.
  Status GradsReady(size_t chunk);
  std::future<Result<StepReport>> Step();

  // engine_checkpoint.cpp.
  Status Save(const std::filesystem::path& dir, const SaveOptions& save_options);
  Status Load(const std::filesystem::path& dir);
  Status ReadMasterParameter(size_t parameter, std::span<float> out);
  /// Copies chunk's optimizer states (master | exp_avg | exp_avg_sq) into `out`, which holds
  /// AlignUp(state_bytes, 4 KiB). Between steps only.
  Status ReadChunkStates(size_t chunk, std::byte* out);
  /// Replaces chunk's optimizer states and working parameters (rounded from the master in
  /// `states`) in their home tiers. Between steps only.
  Status WriteChunkStates(size_t chunk, const std::byte* states);
  /// FailedPrecondition unless the engine is between steps (no step running, no gradients held).
  Status CheckBetweenSteps(const char* operation) const;

  // Shared helpers.
  size_t working_size() const { return DTypeSize(options_.precision.working_dtype); }
  DType working_dtype() const { return options_.precision.working_dtype; }
  /// Blocks until no step is running (the loop has finished the last one).
  void WaitIdle();

  // --- engine_params.cpp internals (mutex_ held) ---
  Status StartFetch(size_t chunk, bool demand, std::unique_lock<std::mutex>& lock);
  std::optional<size_t> PickVictim(size_t target, bool demand) const;
  void Evict(size_t chunk);
  size_t NextUse(size_t chunk) const;  // Distance in the recorded order; max() = not again.
  void RecordAccess(size_t chunk);
  void Prefetch(std::unique_lock<std::mutex>& lock);
  Awaitable<void> FetchChunk(size_t chunk);
  /// Drops every device copy of offloaded parameters (stale after a commit).
  void DropOffloadedCopies();

  // --- engine_step.cpp internals (loop thread) ---
  Awaitable<void> LandGrads(size_t chunk);
  /// Adds a micro-step's working-dtype `grads` into the fp32 `sum` (with accumulation) and, on
  /// the last micro-step, measures what the update will use (any thread but the loop's).
  Result<cpu_adam::GradientStats> SumAndMeasure(float* sum, const void* grads, size_t numel,
                                                int micro_step, bool last);
  /// The gradient buffer is free again (any thread); the last micro-step keeps `stats`.
  void GradsLanded(Chunk& c, bool last, const Result<cpu_adam::GradientStats>& stats);
  void OnChunkArrived(size_t chunk);
  void StartUpdate(size_t chunk);
  Awaitable<Status> UpdateChunk(size_t chunk);
  Awaitable<Status> UpdateChunkOnDevice(size_t chunk);
  void MaybeFinish();
  Awaitable<void> Commit();
  /// Starts reading the optimizer states of the chunks whose gradients come first in backward
  /// (the last chunks) into staging buffers, so NVMe works while the next forward runs.
  void StartPreloads();
  /// Reads one chunk's states into a staging buffer; `preload.ready` says when they are there.
  void StartPreload(size_t chunk);
  Awaitable<void> PreloadStates(size_t chunk);
  /// Waits for preloads in flight and returns every preloaded buffer (loop thread).
  Awaitable<void> DropPreloads();
  void FinishStep(Result<StepReport> result);
  /// One optimizer step over a chunk's arrays (any thread but the loop's).
  Status RunOptimizer(float* states, size_t numel, const void* grads, DType grad_dtype,
                      void* param_copy, double grad_scale, int64_t step);
  bool gated() const;

  EngineOptions options_;
  Device& device_;
  ChunkLayout layout_;
  EngineEnvironment environment_;
  // Budgets before everything that holds reservations on them (destroyed after).
  TierBudget device_budget_;
  TierBudget host_budget_;
  TierBudget nvme_budget_;
  std::vector<BudgetReservation> static_reservations_;

  std::vector<Chunk> chunks_;
  // Host buffers registered for DMA; declared after chunks_ so they are unpinned first.
  std::vector<PinnedHostRegion> pinned_;
  bool transactional_ = false;

  std::optional<cpu_adam::CpuOptimizer> optimizer_;
  std::unique_ptr<nvme::IoEngine> io_;
  std::unique_ptr<nvme::SwapSpace> swap_;
  std::optional<LoopStagingPool> state_staging_;
  std::optional<LoopStagingPool> param_staging_;
  bool state_staging_registered_ = false;  // Its buffers are io_uring fixed buffers.
  DeviceEvent compute_marker_;
  // Zeros as large as the largest chunk's working gradients: the source that clears a gradient
  // buffer when it is allocated, so the padding between parameters is zero, not garbage.
  AlignedBuffer zeros_;

  LossScaler loss_scaler_;
  std::atomic<int64_t> step_count_{0};
  std::atomic<double> lr_;

  // Trainer <-> loop.
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t use_tick_ = 0;
  bool recording_ = true;  // The first step records the order of Acquire calls.
  std::vector<size_t> order_;
  size_t order_position_ = 0;
  bool step_running_ = false;  // Step() called and not yet completed.

  StepState step_;               // Loop thread only.
  size_t preloads_running_ = 0;  // Loop thread only.

  // Metrics: the registry owns them; these point into it (updated from any thread).
  MetricsRegistry metrics_;
  EngineMetrics m_;
  /// Copies the tier budgets' usage into their gauges.
  void UpdateTierGauges();

  // Declared last: destroyed first, so no coroutine outlives what it uses. The arena for
  // blocking jobs (optimizer steps, gradient sums) keeps them off the loop thread.
  tbb::task_arena jobs_{2};
  EventLoop loop_;
};

}  // namespace strata::offload
