// Residency: which chunks' working parameters are on the device for forward and backward, and
// who is using them (ZeRO-3 style parameter offload).
//
// It owns the device copies of offloaded parameters and their gradient buffers (and the memory
// of those it dropped, for the next fetch), the device budget they take, every chunk's pins (the
// trainer's, and the gradient copies' that read a chunk's gradient buffer), the release events that
// mark the trainer's last queued use of a chunk, and the access order recorded in the first step,
// which predicts the next chunks (prefetch) and each chunk's next use (eviction drops the one used
// furthest in the future, Belady's rule; least recently used until the order is known).
//
// Threads: Acquire, Release and PinGrads run on the trainer thread; fetch completions, UnpinGrads
// and Drop on the event loop. Its state is guarded by its own mutex, which is never held while
// waiting for the device, so work queued on a stream may call into the engine.
//
// It works with what Resources and Initialize hand it, not with the engine as a whole.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <vector>

#include "engine/chunk.h"
#include "engine/engine_metrics.h"
#include "engine/loop_sync.h"
#include "strata/core/aligned_buffer.h"
#include "strata/core/device.h"
#include "strata/core/event_loop.h"
#include "strata/nvme/swap_space.h"
#include "strata/offload/engine.h"
#include "strata/offload/tier_budget.h"

namespace strata::offload {

/// Records `event` at the end of the trainer's device work so far on `stream`.
Status RecordTrainerEvent(Device& device, DeviceEvent& event, TrainerStream stream);

class Residency {
 public:
  /// What Residency works with, all owned by the engine (Engine::Impl) and outliving it.
  struct Resources {
    const EngineOptions& options;
    Device& device;
    /// The device budget. The placement reserves the device-home chunks' memory in it at
    /// Create; from then on Residency is its only writer (fetched copies take their slots from
    /// it and give them back when their memory is freed).
    TierBudget& device_budget;
    /// Every chunk's storage, laid out by the placement before Initialize; read only here.
    const std::vector<Chunk>& chunks;
    EngineMetrics& metrics;
    /// Starts a coroutine on the event loop, counted until it ends (Engine::Impl::Spawn).
    std::function<void(Awaitable<void>)> spawn;
  };

  explicit Residency(Resources resources);

  /// Creates every chunk's release event. Call once, after the chunks exist. NVMe-home
  /// parameters are fetched through `param_staging` from `swap` (null when none live there);
  /// `zeros`, as large as any chunk's working gradients, clears a fetched gradient buffer. All
  /// three outlive the fetches.
  Status Initialize(LoopStagingPool* param_staging, nvme::SwapSpace* swap,
                    const AlignedBuffer& zeros);

  /// Pins `chunk` for the trainer, makes its working parameters resident on the device and its
  /// gradient buffer free (the previous micro-step's copy out has read it), blocking until both
  /// hold, and prefetches the chunks expected next. `gathered`: a stage-3 chunk's whole working
  /// parameters (ParamGather), which a fetch copies instead of its home (a shard); a fetch of
  /// such a chunk happens only here, never ahead.
  Result<ChunkView> Acquire(size_t chunk, const std::byte* gathered = nullptr);
  /// Whether the trainer holds `chunk` (acquired and not released). Trainer thread.
  bool Held(size_t chunk) const;
  /// Up to `count` stage-3 chunks (Chunk::params_sharded) that the order recorded in the first
  /// step expects after this access of `chunk`, skipping those the trainer holds; none while
  /// the order is being recorded.
  /// Trainer thread, before Acquire(chunk).
  std::vector<size_t> Upcoming(size_t chunk, size_t count) const;
  /// Unpins a chunk acquired earlier and records the end of the trainer's queued work on it
  /// (on `stream`).
  void Release(size_t chunk, TrainerStream stream);

  /// Holds `chunk`'s gradient buffer for a copy that reads it; the chunk must be acquired.
  /// Returns its device view. FailedPrecondition when the trainer does not hold it.
  Result<ChunkView> PinGrads(size_t chunk);
  /// The copy that PinGrads held the buffer for has read it (any thread).
  void UnpinGrads(size_t chunk);

  /// The lowest chunk the trainer holds, if any.
  std::optional<size_t> FirstAcquired() const;
  /// Makes `stream` wait until the trainer's queued work on every resident chunk has run;
  /// Drop is safe once that work on `stream` has.
  Status OrderAfterTrainerUse(Stream stream);
  /// The same for one chunk, if the trainer has released it (true); false while it holds it.
  Result<bool> OrderAfterTrainerUse(size_t chunk, Stream stream);
  /// Blocks until the trainer's queued work on every resident offloaded chunk has run.
  Status WaitForTrainerUse();
  /// Drops the device copies of `chunks`' offloaded parameters: a commit or a Load made them
  /// stale. Their fetches in flight land stale and are dropped too. None of them may be
  /// acquired, and the trainer's work on them must have run (OrderAfterTrainerUse,
  /// WaitForTrainerUse). Loop thread.
  void Drop(const std::vector<size_t>& chunks);
  /// A step committed: the first one's access order is now known, and each step replays it.
  void StepCommitted();

 private:
  enum class State : uint8_t {
    kAbsent,    ///< Not on the device.
    kFetching,  ///< Memory taken; the parameters are on their way (trainer -> loop).
    kResident,  ///< On the device (loop: fetch landed; always, for device-home chunks).
    kEvicting,  ///< Chosen as a victim; its memory goes once the trainer's work on it has run.
  };

  /// The device memory of an offloaded chunk's copy. The slot is declared first so that it is
  /// released last, after the memory it accounts for.
  struct Memory {
    BudgetReservation slot;
    DeviceBuffer params;
    DeviceBuffer grads;
  };

  /// What the device holds of one chunk.
  struct Copy {
    State state = State::kAbsent;
    Memory memory;         // Offloaded chunks only (device-home ones use Chunk::params and grads).
    DeviceEvent released;  // Recorded at Release: the trainer's last queued use.
    int pins = 0;          // Trainer.
    int grad_pins = 0;     // Gradient copies reading the gradient buffer.
    bool grads_declared = false;  // GradsReady since the last Acquire.
    uint64_t last_use = 0;
    bool stale = false;  // Dropped while fetching: what arrives is thrown away.
    Status fetch_status;
    const std::byte* gathered = nullptr;  // Acquire's, while it waits for the fetch.
  };

  ChunkView ViewLocked(size_t chunk) const;
  Status StartFetchLocked(size_t chunk, bool demand, std::unique_lock<std::mutex>& lock);
  std::optional<size_t> PickVictimLocked(size_t target, bool demand) const;
  void EvictLocked(size_t chunk, std::unique_lock<std::mutex>& lock);
  /// Takes the copy's memory away, into spare_.
  void DropLocked(Copy& copy);
  /// Spare memory of exactly this shape, if there is some.
  std::optional<Memory> TakeSpareLocked(uint64_t slot_bytes, size_t param_bytes, bool grads);
  /// Frees one spare copy's memory (and its budget), without the lock.
  void FreeSpareLocked(std::unique_lock<std::mutex>& lock);
  size_t NextUseLocked(size_t chunk) const;  // Distance in the recorded order; max() = never.
  void RecordAccessLocked(size_t chunk);
  void PrefetchLocked(std::unique_lock<std::mutex>& lock);
  Awaitable<void> Fetch(size_t chunk);

  DType working_dtype() const { return options_.precision.working_dtype; }
  size_t working_size() const { return DTypeSize(working_dtype()); }

  const EngineOptions& options_;
  Device& device_;
  TierBudget& device_budget_;
  const std::vector<Chunk>& chunks_;
  EngineMetrics& metrics_;
  std::function<void(Awaitable<void>)> spawn_;
  LoopStagingPool* param_staging_ = nullptr;  // Set by Initialize, like what follows.
  nvme::SwapSpace* swap_ = nullptr;
  const AlignedBuffer* zeros_ = nullptr;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Copy> copies_;
  // Device memory of copies evicted or dropped (nothing on the device uses it any more), kept
  // with its budget for the next fetch of the same size: allocating per fetch costs a
  // cudaMalloc and a cudaFree, which waits for the whole device, and on HostDevice a fresh
  // mapping whose every page faults on first touch. Freed when a fetch needs room it lacks.
  std::vector<Memory> spare_;
  uint64_t use_tick_ = 0;
  bool recording_ = true;  // The first step records the order of Acquire calls.
  std::vector<size_t> order_;
  size_t order_position_ = 0;
};

}  // namespace strata::offload
