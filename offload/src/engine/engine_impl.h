// Engine::Impl: what the engine's parts share, and the parts themselves.
//
// Parts, each with one owner of its state (docs/architecture.md draws them):
// - Impl lays every chunk's storage out at Create (engine_placement.cpp, and what the host
//   budget decides: engine_host_placement.cpp) and owns the resources the parts use: the
//   device, budgets, chunk storage, NVMe swap space, parameter staging, the CPU kernels and the
//   updaters (update/updater.h), the metrics and the event loop. engine.cpp is the facade and Impl's own life; parameter-state
//   access is engine_state_access.cpp (several ranks: sharded_state_access.cpp). Its state is
//   private: a part is handed what it uses.
// - Chunk (chunk.h) is one chunk's storage in every tier and its layout; the transition that
//   changes several of its fields at once is its method (FlipNvmeShadows).
// - Residency (residency.h) owns the device copies of offloaded parameters, pins, eviction and
//   prefetch, and after the placement is the only writer of the device budget.
// - StepPipeline (step_pipeline.h) owns each chunk's part in the step (its phase, micro-step
//   count, landing, collectives' signals and update flags: ChunkStep, step/chunk_step.h, which
//   only the step's files see; others ask through narrow accessors; it reaches the engine
//   through StepEngine, step/step_engine.h, which Impl implements), the gradient landing
//   (step_landing.cpp), the per-chunk update journeys (step_update.cpp), the delayed update
//   (step_delayed.cpp), the collectives of several ranks (step_sharded.cpp) and the commit
//   (step_commit.cpp).
// - StatePreloader (state_preloader.h), the pipeline's, owns the read-ahead of NVMe-kept
//   states: their staging pool, a slot per chunk, and the depth and order policy.
// - ParamGather (param_gather.h) owns ZeRO stage 3's gather slots and their collectives.
// - ReduceRing (reduce_ring.h) owns the buffers several ranks reduce gradients from.
// - Checkpoints (checkpoint/engine_checkpoint.cpp) read and write chunk states between steps.
//
// Threads: the trainer thread calls the public methods; the event loop thread runs every
// coroutine (fetches, landings, journeys, preloads, the commit) and does no hashing and no
// waiting; the job threads `jobs_` run the optimizer (on its own oneTBB arena), gradient sums
// and checksums; the device's stream threads run host functions, which only post to the loop;
// the I/O thread completes NVMe requests. Residency and StepPipeline each guard what the trainer
// and the loop share with a mutex of their own.
#pragma once

#include <tbb/info.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <vector>

#include "checkpoint/checkpoint_manifest.h"
#include "engine/chunk.h"
#include "engine/engine_metrics.h"
#include "engine/loop_sync.h"
#include "residency/residency.h"
#include "sharding/param_gather.h"
#include "sharding/reduce_ring.h"
#include "step/step_engine.h"
#include "step/step_pipeline.h"
#include "update/updater.h"
#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"
#include "strata/core/event_loop.h"
#include "strata/core/staging_pool.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "strata/nvme/async_io.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_space.h"
#include "strata/offload/engine.h"

namespace strata::offload {

class Engine::Impl final : public StepEngine {
 public:
  Impl(const EngineOptions& options, Device& device, ChunkLayout layout,
       EngineEnvironment environment);
  ~Impl();

  // engine_placement.cpp: creation, every chunk placed and its storage allocated.
  Status Initialize(std::span<const ParameterSpec> parameters);

  // The trainer's calls (range checks here, the work in the parts).
  Result<ChunkView> Acquire(size_t chunk);
  void Release(size_t chunk, TrainerStream stream);
  Status GradsReady(size_t chunk, TrainerStream stream);

  // engine_checkpoint.cpp.
  Status Save(const std::filesystem::path& dir, const SaveOptions& save_options);
  Status CheckSaveTarget(const std::filesystem::path& dir) const;
  Status Load(const std::filesystem::path& dir);

  // engine_state_access.cpp (several ranks: sharded_state_access.cpp).
  Status ReadParameterStates(std::span<const ParameterStateRead> reads);
  Status WriteParameterStates(std::span<const ParameterStateWrite> writes);
  Status SetStepCount(int64_t steps);

  // What the parts ask of the engine's configuration.
  /// This rank and the ranks the chunks are sharded across (1: not sharded). Fixed by the
  /// layout (the communicator goes before the engine's last coroutines do).
  int rank() const override { return rank_; }
  int ranks() const override { return layout_.world_size(); }
  bool sharded() const override { return ranks() > 1; }
  /// ZeRO stage 3 across several ranks: Acquire gathers trained chunks' parameters
  /// (ParamGather), so every rank's Acquire calls are collectives.
  bool gathers_params() const override { return sharded() && options_.placement.zero_stage == 3; }
  /// Several ranks reduce through the ReduceRing: without accumulating micro-steps (a chunk's
  /// fp32 gradients need to exist only until they are reduced, not all step long), when every
  /// micro-step is reduced, and with quantized gradients (what the all-to-all sends and
  /// receives).
  bool reduces_from_ring() const override {
    return sharded() && (options_.optimizer.gradient_accumulation_steps == 1 ||
                         reduces_each_micro_step() || quantizes_gradients());
  }
  /// ZeRO stages 2 and 3 with gradient accumulation: every micro-step's gradients are
  /// reduce-scattered as they land and summed into this rank's shard, so no rank keeps a whole
  /// chunk's fp32 sum (DeepSpeed's stage 2; stage 1 keeps the sum and reduces once a step,
  /// moving 1/gas of the gradient bytes).
  bool reduces_each_micro_step() const override {
    return sharded() && options_.placement.zero_stage >= 2 &&
           options_.optimizer.gradient_accumulation_steps > 1;
  }
  /// Zero copy on a device whose memory is the CPU's (DeviceProperties::host_accessible): the
  /// landing of `c` reads its gradients where backward wrote them instead of copying them out
  /// (ChunkStep::landed_grads), and its update may write the new parameters straight into the
  /// device's (StepPipeline::ClaimParamsInPlace). For device-home parameters, whose buffers stay
  /// put, and states the host updates; one rank (the ReduceRing widens what landed when its turn
  /// comes), and no delayed update (the next forward's Acquire does not wait for the step).
  bool ZeroCopy(const Chunk& c) const override {
    return device_.properties().host_accessible && !sharded() &&
           !options_.optimizer.delayed_update && c.placement.params == Tier::kDevice &&
           !c.frozen() && c.placement.optimizer_states != Tier::kDevice;
  }
  /// Host-kept chunks sum their micro-steps' gradients in grads_sum (fp32, the whole chunk).
  bool sums_micro_steps() const override {
    return options_.optimizer.gradient_accumulation_steps > 1 && !reduces_each_micro_step();
  }
  /// ZeRO++'s quantized gradients: reduced by an all-to-all of blockwise int8 or int4
  /// partitions.
  bool quantizes_gradients() const override { return sharded() && options_.placement.quantized_gradients; }
  /// Their width, 8 or 4 (cpu_adam::IsQuantBits).
  int gradient_quant_bits() const override { return options_.placement.quantized_gradient_bits; }
  /// Elements of this rank's shard of the largest trained chunk (every rank's is as large):
  /// what a quantized collective's per-rank buffers hold.
  size_t max_trained_shard_numel() const;
  /// Unavailable naming what is not built for several ranks (stage 0, stage 3's shards
  /// anywhere but host memory, offloaded parameters with stages 1 and 2, device-kept states,
  /// the delayed update); OK for one rank.
  Status CheckShardable() const;
  /// Elements of this rank's share of the largest chunk whose states are on NVMe (what state
  /// staging holds).
  size_t max_nvme_state_numel() const;
  /// Bytes of the largest NVMe-home working parameters (Chunk::param_home_bytes: with stage 3
  /// a shard; what parameter staging holds); 0 when none are on NVMe.
  size_t max_nvme_param_bytes() const;

  size_t working_size() const override { return DTypeSize(options_.precision.working_dtype); }
  /// The largest of the chunks' state_bytes (a frozen chunk's are just its values).
  size_t max_state_bytes() const;
  /// Elements of the largest chunk that has optimizer states: what staging for states and zero
  /// gradients must hold (a frozen embedding may be far larger). 0 when every chunk is frozen.
  size_t max_trained_numel() const;
  DType working_dtype() const override { return options_.precision.working_dtype; }
  /// Gated steps update ahead of their verdict (OptimizerOptions::speculative_updates).
  bool Speculates() const override;

  /// Starts `work` on the event loop, counted until it finishes (WaitIdle).
  void Spawn(Awaitable<void> work) override;
  /// Blocks until no coroutine started by Spawn is running.
  void WaitIdle();
  /// Copies the tier budgets' usage into their gauges.
  void UpdateTierGauges();

  // What the facade (engine.cpp) answers from.
  const ChunkLayout& layout() const { return layout_; }
  StepPipeline& pipeline() { return pipeline_; }
  ParamGather& param_gather() { return param_gather_; }
  TierUsage tier_usage(Tier tier) const;
  MetricsRegistry& metrics_registry() { return metrics_; }

  // What the step pipeline drives (StepEngine, step/step_engine.h): the parts and resources
  // above and below stay this class's.
  bool transactional() const override { return transactional_; }
  std::vector<Chunk>& chunks() override { return chunks_; }
  Device& device() override { return device_; }
  Residency& residency() override { return residency_; }
  ReduceRing& reduce_ring() override { return reduce_ring_; }
  Communicator& communicator() override { return *environment_.communicator; }
  nvme::SwapSpace* swap() override { return swap_.get(); }
  LoopStagingPool* param_staging() override {
    return param_staging_ ? &*param_staging_ : nullptr;
  }
  DeviceEvent& compute_marker() override { return compute_marker_; }
  cpu_adam::CpuOptimizer& cpu() override { return *optimizer_; }
  Updaters& updaters() override { return *updaters_; }
  EngineMetrics& metrics() override { return m_; }
  EventLoop& loop() override { return loop_; }
  JobThreads& jobs() override { return jobs_; }
  JobCounter& jobs_in_flight() override { return jobs_in_flight_; }

 private:
  // No friends: every part is handed what it uses (Residency, ParamGather and the
  // StatePreloader their references, StepPipeline the StepEngine interface above), and the
  // facade asks through the public accessors.

  // engine_placement.cpp: the placement's steps, which Initialize runs in this order.
  /// The communicator (one rank's own, when none was given) and this rank; refuses what is not
  /// built for several ranks (CheckShardable).
  Status JoinRanks();
  /// Unavailable for optimizer states kept in device memory where no updater serves the device
  /// (a GPU's: not built yet).
  Status CheckDeviceStatesBuilt() const;
  /// Creates chunks_ from the layout: each chunk's size, shard and the tiers the options ask
  /// for (parameters within placement.max_params_in_host cached in host memory).
  void LayOutChunks();
  /// Device-home parameters and their gradients, within the device budget.
  Status PlaceDeviceParams();
  /// Optimizer states kept on the device (every chunk's, or the 1 - offload_ratio share, the
  /// first chunks), as many as the device budget holds; the rest go to the host.
  Status PlaceDeviceStates();
  /// NVMe-homed states within placement.max_states_in_host stay in host memory instead.
  void KeepStatesInHost();
  /// ResourceExhausted unless the device has room left to fetch the largest offloaded chunk.
  Status CheckFetchRoom() const;
  /// Several ranks: stage 3's gather slots and the ReduceRing's buffers, from the host budget.
  Status ReserveCollectiveBuffers();
  /// Every chunk's host buffers (HostBuffersOf), zeroed, and the ones device copies use pinned.
  Status AllocateHostBuffers();
  /// The I/O engine, swap space and every NVMe-home chunk's current and shadow extents; sets
  /// transactional_.
  Status PlaceOnNvme();
  /// The NVMe staging pools: the parameters', and the states' that the StatePreloader reads
  /// ahead into (sized here, from what the host budget has left).
  Status CreateNvmeStaging();
  /// Every chunk's initial states and working parameters, written where they live.
  Status WriteInitialValues(std::span<const ParameterSpec> parameters);
  /// The parts' own initialization, the optimizer and the metrics, once the chunks are placed.
  Status StartParts();
  /// The indices of the chunks with optimizer states, in order.
  std::vector<size_t> TrainedChunks() const;

  // engine_checkpoint.cpp: Save's and Load's steps.
  /// The whole checkpoint's bytes: every rank's shard of each trained chunk, frozen ones once.
  uint64_t CheckpointBytes() const;
  /// Save with several ranks: `ready` is this rank's readiness (an error fails it everywhere).
  Status SaveSharded(const std::filesystem::path& dir, uint64_t bytes_needed, Status ready,
                     const SaveOptions& save_options);
  /// Writes this rank's chunk files into `writer` (its shards; the frozen chunks it saves, see
  /// FrozenChunkSaver), their digests into `digests` (one per chunk; untouched for a file it
  /// does not write).
  Status WriteChunkFiles(internal::CheckpointWriter& writer,
                         std::vector<internal::FileDigest>& digests,
                         const SaveOptions& save_options);
  /// The rank that saves frozen chunk `chunk`, which every rank holds whole: they take turns.
  int FrozenChunkSaver(size_t chunk) const { return int(chunk % size_t(ranks())); }
  /// The manifest of a checkpoint whose files have `digests`: per chunk, or with several ranks
  /// every rank's per chunk, rank after rank.
  nlohmann::json CheckpointManifest(std::span<const internal::FileDigest> digests) const;
  /// Load's checks, the manifest and every file verified, before anything changes; `reader` is
  /// the checkpoint opened.
  Result<internal::EngineManifest> OpenVerified(const std::filesystem::path& dir,
                                                std::optional<internal::CheckpointReader>& reader);
  /// Loads a checkpoint OpenVerified accepted, whatever world size saved it.
  Status LoadVerified(const internal::CheckpointReader& reader,
                      const internal::EngineManifest& saved);
  /// The loss scaler's state after loading `saved` (the saved one, or this engine's fresh one
  /// when their precisions differ).
  LossScalerState ScalerAfterLoad(const internal::EngineManifest& saved) const;

  // engine_state_access.cpp.
  /// What every read or write of a batch needs (the parameter, its size, its state; between
  /// steps and with no chunk acquired for writes), checked before any is done.
  Status CheckReads(std::span<const ParameterStateRead> reads);
  Status CheckWrites(std::span<const ParameterStateWrite> writes);
  /// Several ranks (sharded_state_access.cpp): collectives that every rank calls with the same
  /// batch. Reads gather each chunk's shards; writes change each rank's shard and refresh the
  /// working parameters from the gathered master. Chunk by chunk, every rank stops where one
  /// fails, so all of them hold the same chunks written.
  Status ReadShardedParameterStates(std::span<const ParameterStateRead> reads);
  Status WriteShardedParameterStates(std::span<const ParameterStateWrite> writes);
  /// InvalidArgument on every rank, naming the odd ones, unless every rank passed the same
  /// `words` (a batch's parameters and states, a step count): state access across ranks is a
  /// collective, and a rank asking for something else would wait in another one.
  Status AgreeOnCall(std::span<const uint64_t> words, const std::string& what);
  /// Copies chunk's optimizer states (master | exp_avg | exp_avg_sq; a frozen chunk's values)
  /// into `out`, which holds AlignUp(state_bytes, 4 KiB). Between steps only.
  Status ReadChunkStates(size_t chunk, std::byte* out);
  /// A frozen chunk's working parameters, from their home, widened to fp32 into `out` (numel).
  Status ReadFrozenValues(size_t chunk, float* out);
  /// Writes chunk's optimizer states and working parameters (rounded from the master in
  /// `states`) where they live on NVMe: into the current extents, or the shadow ones (which a
  /// commit or Load then flips current).
  Status WriteNvmeHome(size_t chunk, const std::byte* states, bool shadow);
  /// The same for what lives in host or device memory. `master`: the whole chunk's master, for
  /// its working parameters, where `states` holds only this rank's shard (null: the master in
  /// `states`).
  Status WriteMemoryHome(size_t chunk, const std::byte* states, const float* master = nullptr);
  /// Blocks until nothing reads or writes what WriteMemoryHome replaces: no fetch in flight, and
  /// the trainer's queued device work on every chunk has run. Trainer thread, between steps.
  Status WaitForQuietMemory();
  /// After new state went to the shadow extents of `chunks` (WriteNvmeHome) and memory (after
  /// WaitForQuietMemory): makes the shadows current, drops device copies and preloads made
  /// stale, and reads ahead again. Trainer thread, between steps.
  Status SwitchToNewState(const std::vector<size_t>& chunks);

  // engine_host_placement.cpp: what the host budget decides.
  /// A host buffer a chunk needs where it is placed: what Initialize allocates and reserves.
  struct HostBuffer {
    AlignedBuffer* buffer;
    size_t bytes;
    std::string what;
  };
  std::vector<HostBuffer> HostBuffersOf(size_t chunk);
  /// InvalidArgument unless optimizer.delayed_update is off or every trained chunk is placed as
  /// it needs: parameters on the device, optimizer states off it.
  Status CheckDelayedUpdatePlacement() const;
  /// What optimizer.recheck_gradients needs (options.h): Unavailable or InvalidArgument naming
  /// what is missing.
  Status CheckRecheckPlacement() const;
  /// Host budget the engine's own allocations take with the chunks placed as they are: every
  /// chunk's host buffers and the NVMe staging pools.
  uint64_t HostBytesNeeded();
  /// With states on host that the host budget cannot hold next to the rest, and NVMe paths to
  /// put them on: the last chunks' states (their gradients arrive first, leaving the most time
  /// to read states back) move to NVMe until the rest fits, skipping chunks larger than needed
  /// (their staging would cost more than they free). Says what it did; changes nothing when no
  /// spill fits.
  void SpillStatesToNvme();
  /// An optional buffer of `bytes` (not zeroed) for as long as the engine lives, where the host
  /// budget has room left; nullopt otherwise (or when the allocation fails).
  std::optional<AlignedBuffer> AllocateWithinBudget(size_t bytes);
  /// Gated steps with speculative updates, after the host shadows: Chunk::params_before for
  /// each NVMe-kept chunk with device parameters, where the host budget has room. Never fails.
  void AllocateParamsBefore();
  /// Whether speculative updates want a second buffer of chunk `c`'s host-kept states
  /// (AllocateStateShadows), or its parameters from before (AllocateParamsBefore).
  bool WantsStateShadow(const Chunk& c) const;
  bool WantsParamsBefore(const Chunk& c) const;
  /// The host memory those two would take for every chunk that wants them.
  uint64_t SpeculationBytes() const;
  /// Gated steps with speculative updates: a shadow buffer for each host-kept chunk's states,
  /// for as many chunks as the host budget has room left (the last chunks first), so their
  /// updates can run before the global norm is known. Never fails: chunks without one wait.
  void AllocateStateShadows();

  const EngineOptions options_;
  Device& device_;
  ChunkLayout layout_;
  EngineEnvironment environment_;
  int rank_ = 0;  // environment_.communicator's rank (Initialize).
  // Budgets before everything that holds reservations on them (destroyed after).
  TierBudget device_budget_;
  TierBudget host_budget_;
  TierBudget nvme_budget_;
  std::vector<BudgetReservation> static_reservations_;

  std::vector<Chunk> chunks_;
  // Host buffers registered for DMA; declared after chunks_ so they are unpinned first.
  std::vector<PinnedHostRegion> pinned_;
  // A state or parameter home is on NVMe, so a step can fail after its updates (new values go
  // to shadow extents that the commit flips): device-kept states, stepped in place with nothing
  // to undo them by, are updated at the commit.
  bool transactional_ = false;

  // The CPU's vectorized kernels on their own oneTBB arena: gradient sums, norms, checksums and
  // quantization on host memory, and what the CPU updater steps with.
  std::optional<cpu_adam::CpuOptimizer> optimizer_;
  // What steps each chunk's states (update/updater.h), chosen by the device (StartParts).
  std::optional<Updaters> updaters_;
  std::unique_ptr<nvme::IoEngine> io_;
  std::unique_ptr<nvme::SwapSpace> swap_;
  // Offloaded parameters' NVMe staging (Residency's fetches, the updates' writes). The states'
  // is the step pipeline's (StatePreloader).
  std::optional<LoopStagingPool> param_staging_;
  DeviceEvent compute_marker_;  // Re-recorded by each GradsReady (trainer thread).
  // Zeros as large as the largest chunk's working gradients: the source that clears a gradient
  // buffer when it is allocated, so the padding between parameters is zero, not garbage.
  AlignedBuffer zeros_;

  // Metrics: the registry owns them; these point into it (updated from any thread).
  MetricsRegistry metrics_;
  EngineMetrics m_;

  // The parts. Their coroutines run on loop_ and their jobs in jobs_.
  Residency residency_{{.options = options_,
                        .device = device_,
                        .device_budget = device_budget_,
                        .chunks = chunks_,
                        .metrics = m_,
                        .spawn = [this](Awaitable<void> work) { Spawn(std::move(work)); }}};
  StepPipeline pipeline_{*this, options_};
  ParamGather param_gather_{{.options = options_,  // See param_gather.h for its threads.
                             .device = device_,
                             .chunks = chunks_,
                             .ranks = layout_.world_size(),
                             .metrics = m_}};
  ReduceRing reduce_ring_;  // See reduce_ring.h for its threads.

  JobCounter jobs_in_flight_;  // Every AwaitJob of the parts counts here.
  // Coroutines started by Spawn and not yet finished.
  std::mutex work_mutex_;
  std::condition_variable work_idle_;
  size_t work_running_ = 0;

  // Destroyed before every member above, so no coroutine outlives what it uses.
  EventLoop loop_;
  // The threads for blocking jobs (optimizer steps, gradient sums, checksums) keep them off the
  // loop thread: two, or one where the process may use a single CPU (a rank bound to a core).
  // Declared after the loop: joined while it still exists, so a job's post always finds it
  // (the destructor waits for jobs_in_flight_ first anyway).
  JobThreads jobs_{std::min(2, tbb::info::default_concurrency())};
};

}  // namespace strata::offload
