// Engine: what a trainer embeds to train a model whose state does not fit on its device.
//
// The engine owns every piece of training state except activations: the working parameters
// (fp32/bf16/fp16) and their gradients on the device, and the fp32 master parameters and
// optimizer moments in whichever tier EngineOptions::placement names (device, pinned host
// memory or NVMe). Parameters are packed into chunks (see chunk_layout.h). A trainer drives it:
//
//   STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(options, device, parameters));
//   for (int step = 0; step < steps; ++step) {
//     for (int micro = 0; micro < options.optimizer.gradient_accumulation_steps; ++micro) {
//       for (size_t c = 0; c < engine->chunk_count(); ++c) {       // forward, chunk order
//         STRATA_ASSIGN_OR_RETURN(ChunkView view, engine->Acquire(c));
//         RunForward(view.params, ...);                           // on Stream::kCompute
//         engine->Release(c);
//       }
//       for (size_t c = engine->chunk_count(); c-- > 0;) {         // backward, reverse order
//         STRATA_ASSIGN_OR_RETURN(ChunkView view, engine->Acquire(c));
//         RunBackward(view.params, view.grads, loss_scale ...);   // writes view.grads
//         STRATA_RETURN_IF_ERROR(engine->GradsReady(c));          // offload starts now
//         engine->Release(c);
//       }
//     }
//     STRATA_ASSIGN_OR_RETURN(StepReport report, engine->Step().get());
//   }
//
// What happens underneath: GradsReady queues the chunk's gradients device->host behind the
// trainer's compute-stream work; on the last micro-step the chunk's optimizer step starts at
// once (with gradient clipping or fp16 overflow checks too: it runs as if the step will neither
// clip nor overflow, and is redone or undone in the rare step that does; see
// OptimizerOptions::speculative_updates). Each chunk's journey (states NVMe->host, CPU Adam,
// parameters host->device, states host->NVMe) is a coroutine on the engine's event loop; journeys
// of different chunks overlap each other and the trainer's backward, bounded by staging buffers.
// Step() completes when every chunk is updated and its working parameters are where the next
// forward needs them.
//
// Gradients written by backward are summed over micro-steps by the engine (in host fp32); like
// DeepSpeed, the trainer divides its loss by gradient_accumulation_steps if it wants a mean.
// With fp16, the trainer multiplies its loss by loss_scale() before backward.
//
// Failures: an error in any chunk's journey (an NVMe read or write, say) fails the step, and
// calling Step() again retries it from the gradients the engine still holds, finishing the same
// step exactly once (no chunk is stepped twice). What a failed step leaves: NVMe-home states
// and parameters are as before it (new values go to shadow extents that only a successful
// commit makes current), and so are host-home states updated ahead of a clipping or fp16
// verdict (their new values wait in a second buffer); other host- and device-home states of
// chunks that got that far are already stepped in place, and device-home parameters of chunks
// whose update was complete may already be the new ones (the retry does not update those chunks
// again). Until the retry succeeds, only Step() and reads are accepted; even Acquire is refused
// for a chunk whose states the device keeps and still has to update (without gradient
// accumulation the device reads the failed step's gradients from the chunk's gradient buffer,
// which the trainer would write next).
//
// Thread safety: Acquire, Release, GradsReady, Step, Save, Load and the parameter-state calls
// (ReadParameterState(s), WriteParameterState(s), ReadMasterParameter, SetStepCount) are called
// by one trainer thread (not concurrently with each other); with several ranks each of them is
// a collective or may start one, so every rank makes the same calls in the same order (a rank
// alone reading a parameter for export would meet the others' next collective instead).
// metrics(), tier_usage() and the const accessors may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strata/core/device.h"
#include "strata/core/metrics.h"
#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/nvme/io_backend.h"
#include "strata/offload/chunk_layout.h"
#include "strata/offload/communicator.h"
#include "strata/offload/tier_budget.h"

namespace strata::offload {

/// A chunk's device memory while it is acquired. Pointers are device addresses (host memory on
/// HostDevice) valid until Release; `numel` elements of the working dtype each.
struct ChunkView {
  void* params = nullptr;  ///< Working parameters: read by forward and backward.
  /// Gradients: written by backward (see GradsReady for accumulation). Null for a frozen chunk.
  void* grads = nullptr;
  size_t numel = 0;
  DType dtype = DType::kFp32;
};

/// A stream of an outside trainer (one that owns its compute, like PyTorch) on which it queued
/// the work that the engine must order its own after. Default: the device's Stream::kCompute,
/// where a trainer that runs its kernels through the engine's Device queues them.
struct TrainerStream {
  /// The trainer's native stream: a cudaStream_t on CUDA (torch.cuda.current_stream()
  /// .cuda_stream), HostStream::native() on HostDevice. Null = Stream::kCompute, so CUDA's
  /// legacy default stream, whose handle is 0, must be named cudaStreamLegacy (1), as
  /// strata.torch does.
  void* native = nullptr;
};

/// What one Step() did.
struct StepReport {
  int64_t step = 0;       ///< Optimizer steps taken so far (skipped steps do not count).
  int64_t iteration = 0;  ///< Steps completed so far, skipped ones included (DeepSpeed's
                          ///< global_steps).
  bool skipped = false;   ///< fp16 overflow: nothing was updated and the scale was lowered.
  /// Some chunks were updated ahead of the global norm (OptimizerOptions::speculative_updates)
  /// and the step clipped or overflowed, or their gradients changed before Step()
  /// (recheck_gradients), so those updates were redone or undone.
  bool rolled_back = false;
  /// optimizer.recheck_gradients: chunks whose gradients the trainer changed between GradsReady
  /// and Step() (clipping, unscaling, an edit); this step used them as they were at Step().
  int64_t changed_chunks = 0;
  /// Global L2 norm of the (unscaled) gradients; NaN when skipped, or when a gradient was not
  /// finite (without a loss scaler such a step still updates; clipping bounds the finite
  /// chunks by their own norm).
  double grad_norm = 0.0;
  double loss_scale = 1.0;  ///< The scale the next backward should use.
  double seconds = 0.0;     ///< From Step() to completion.

  /// Calls `visit(name, member)` for every field, in declaration order: `member` points to it,
  /// `name` is its name as reports spell it (strata.torch's last_step keys). The one list that
  /// code enumerating the fields walks, so a new field is one line here; tests/offload/
  /// report_fields_test.cpp fails when a field is left out of it.
  template <typename Visit>
  static constexpr void ForEachField(Visit&& visit) {
    visit("step", &StepReport::step);
    visit("iteration", &StepReport::iteration);
    visit("skipped", &StepReport::skipped);
    visit("rolled_back", &StepReport::rolled_back);
    visit("changed_chunks", &StepReport::changed_chunks);
    visit("grad_norm", &StepReport::grad_norm);
    visit("loss_scale", &StepReport::loss_scale);
    visit("seconds", &StepReport::seconds);
  }
};

/// Bytes moved between tiers and time spent per resource since the engine started.
struct EngineCounters {
  uint64_t device_to_host_bytes = 0;
  uint64_t host_to_device_bytes = 0;
  uint64_t nvme_read_bytes = 0;
  uint64_t nvme_write_bytes = 0;
  double optimizer_seconds = 0.0;        ///< Busy time of the CPU optimizer (sum over chunks).
  uint64_t optimizer_params = 0;         ///< Parameters updated by the CPU optimizer.
  uint64_t device_optimizer_params = 0;  ///< Parameters updated on the device.
  uint64_t evictions = 0;                ///< Offloaded parameter chunks dropped from the device.
  uint64_t fetches = 0;                  ///< Offloaded parameter chunks brought to the device.
  /// Working-parameter bytes of those fetches, by the tier they came from (host memory, or
  /// NVMe through a staging buffer); gradient buffers cleared on the way are not counted.
  uint64_t fetched_from_host_bytes = 0;
  uint64_t fetched_from_nvme_bytes = 0;
  /// Time the trainer was blocked in Acquire: on a fetch (from host or NVMe), on the previous
  /// micro-step's gradients copying out, or on room in the device budget. What parameter offload
  /// costs a step beyond everything resident.
  double fetch_stall_seconds = 0.0;
  /// Chunk updates run ahead of a gated step's verdict (speculative_updates), and how many of
  /// them the verdict rolled back (a clipped or overflowing step).
  uint64_t speculative_updates = 0;
  uint64_t rolled_back_updates = 0;
  /// With several ranks: bytes of the chunks whose gradients were reduce-scattered and whose
  /// parameters were all-gathered (ZeRO's Ψ per step: stages 1 and 2 move 2Ψ, stage 3 3Ψ when
  /// the trainer acquires in the order of the first step; a chunk gathered ahead that the
  /// trainer did not come to counts too).
  uint64_t reduce_scatter_bytes = 0;
  uint64_t all_gather_bytes = 0;

  /// Field by field (ForEachField), for totals over steps and traffic between two readings.
  EngineCounters& operator+=(const EngineCounters& other);
  EngineCounters& operator-=(const EngineCounters& other);

  /// Every field, as StepReport::ForEachField lists its own (names: strata.torch's metrics()
  /// keys). The sums above and the Python dict walk it: a new counter is its member, one line
  /// here and its reading in Engine::counters().
  template <typename Visit>
  static constexpr void ForEachField(Visit&& visit) {
    visit("device_to_host_bytes", &EngineCounters::device_to_host_bytes);
    visit("host_to_device_bytes", &EngineCounters::host_to_device_bytes);
    visit("nvme_read_bytes", &EngineCounters::nvme_read_bytes);
    visit("nvme_write_bytes", &EngineCounters::nvme_write_bytes);
    visit("optimizer_seconds", &EngineCounters::optimizer_seconds);
    visit("optimizer_params", &EngineCounters::optimizer_params);
    visit("device_optimizer_params", &EngineCounters::device_optimizer_params);
    visit("evictions", &EngineCounters::evictions);
    visit("fetches", &EngineCounters::fetches);
    visit("fetched_from_host_bytes", &EngineCounters::fetched_from_host_bytes);
    visit("fetched_from_nvme_bytes", &EngineCounters::fetched_from_nvme_bytes);
    visit("fetch_stall_seconds", &EngineCounters::fetch_stall_seconds);
    visit("speculative_updates", &EngineCounters::speculative_updates);
    visit("rolled_back_updates", &EngineCounters::rolled_back_updates);
    visit("reduce_scatter_bytes", &EngineCounters::reduce_scatter_bytes);
    visit("all_gather_bytes", &EngineCounters::all_gather_bytes);
  }
};

inline EngineCounters operator-(EngineCounters a, const EngineCounters& b) { return a -= b; }

/// Where each chunk's state lives (decided at Create from the placement options and budgets).
struct ChunkPlacement {
  Tier params = Tier::kDevice;  ///< Home of its working parameters between uses.
  /// Home of its fp32 master parameters and moments; unset for a frozen chunk, which has none.
  std::optional<Tier> optimizer_states = Tier::kHost;
};

/// One of a parameter's optimizer states, as torch.optim's state_dict names them.
enum class ParameterState : int {
  kMaster = 0,    ///< The fp32 master value of the parameter.
  kExpAvg = 1,    ///< First moment ("exp_avg"; Lion's momentum).
  kExpAvgSq = 2,  ///< Second moment ("exp_avg_sq"; Adagrad's sum of squares).
};

/// One parameter state to read in a batch (Engine::ReadParameterStates): `out` holds numel
/// floats.
struct ParameterStateRead {
  size_t parameter = 0;
  ParameterState state = ParameterState::kMaster;
  std::span<float> out;
};

/// One parameter state to write in a batch (Engine::WriteParameterStates).
struct ParameterStateWrite {
  size_t parameter = 0;
  ParameterState state = ParameterState::kMaster;
  std::span<const float> values;
};

/// Options of Save that do not belong in EngineOptions.
struct SaveOptions {
  /// Called after each chunk's file is written and synced, with (chunks done, chunks total),
  /// on the calling thread. For progress output.
  std::function<void(size_t done, size_t total)> on_chunk_saved;
};

/// What an engine is plugged into besides its options.
struct EngineEnvironment {
  /// Collectives across data-parallel ranks; null = a single rank. With several ranks every
  /// rank's trainer makes the same calls in the same order — GradsReady and Step always, and
  /// with placement.zero_stage 3 Acquire too (each Acquire of a chunk the trainer does not
  /// hold gathers its parameters from every rank): a rank that evaluates or reads parameters
  /// alone waits for the others until placement.collective_timeout_seconds.
  std::unique_ptr<Communicator> communicator;
  /// Ranks sharing this node's memory and cores: the automatic host budget and CPU optimizer
  /// threads are divided among them, so that 8 ranks do not each take 80% of memory and every
  /// core. 0 (the default) = the launcher's count (DetectRanks' local_size; 1 without one).
  int ranks_on_node = 0;
  /// Wraps the NVMe I/O backend the engine creates (tests inject faults with it).
  std::function<std::unique_ptr<nvme::IoBackend>(std::unique_ptr<nvme::IoBackend>)> wrap_io_backend;
};

class Engine {
 public:
  /// Creates an engine on `device` (which must outlive it) for `parameters`, packed into chunks,
  /// and places every chunk's state per `options` (validated here). Initial values are copied.
  /// Errors: InvalidArgument for bad options or parameters; ResourceExhausted (naming the tier,
  /// its budget and the minimum needed) when a budget cannot hold even one chunk's working set or
  /// the states placed there; Unavailable for a placement this build cannot run (optimizer
  /// steps on a CUDA device, more than one rank); NotFound/IoError for unusable nvme paths.
  static Result<std::unique_ptr<Engine>> Create(const EngineOptions& options, Device& device,
                                                std::span<const ParameterSpec> parameters,
                                                EngineEnvironment environment = {});

  /// Waits for in-flight work (a running step finishes first), then frees every tier.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const ChunkLayout& layout() const;
  size_t chunk_count() const { return layout().chunk_count(); }
  const ChunkPlacement& placement(size_t chunk) const;
  DType working_dtype() const;
  /// The device this engine was created on: where ChunkView memory lives, and the streams a
  /// trainer's copies to and from that memory go through.
  Device& device() const;

  /// Makes `chunk`'s working parameters resident on the device and its gradient buffer free for
  /// backward, blocking until both hold, and prefetches the chunks expected next (from the order
  /// recorded during the first step). Pins the chunk until Release. The view's memory stays
  /// put while the chunk is acquired (a trainer's tensors may view it); a chunk whose
  /// parameters live on the device (placement(chunk).params == Tier::kDevice) keeps the same
  /// memory for the engine's lifetime, so a trainer may keep tensors viewing it between
  /// acquisitions, as PyTorch parameters do. The engine orders its own writes to that memory
  /// (a step's new parameters, Load, WriteParameterState) only after the trainer's work up to
  /// the chunk's last Release: device work on such views queued after that must be complete
  /// before Step(), Load or a state write. A trainer's own writes to the views are working
  /// values only: the next step computes from the fp32 master, so write it too
  /// (WriteParameterState) for the change to last. ResourceExhausted when
  /// the device budget cannot hold the chunk even after evicting every unpinned chunk;
  /// FailedPrecondition from the chunk's last GradsReady of a step until the step completes
  /// (its update may be running).
  Result<ChunkView> Acquire(size_t chunk);
  /// Unpins a chunk acquired earlier (it may be evicted from now on). The trainer's work on it
  /// so far, queued on `stream`, finishes before its memory is reused or overwritten.
  void Release(size_t chunk, TrainerStream stream = {});

  /// Declares that backward has written `chunk`'s gradients by work queued on `stream` so far.
  /// The engine copies them to the host behind that work, and on the last micro-step of an
  /// optimizer step may start the chunk's update at once. The chunk must be acquired.
  ///
  /// Gradient semantics: the engine reads view.grads as this micro-step's gradients and sums
  /// micro-steps itself. A fetched chunk's gradient buffer starts at zero; a device-home
  /// chunk's holds what the trainer last wrote. So a trainer whose autograd accumulates into
  /// view.grads (PyTorch's .grad) must zero it before each micro-step's backward, as
  /// optimizer.zero_grad() does, or micro-steps are counted twice.
  ///
  /// FailedPrecondition when the chunk already received every micro-step's gradients for this
  /// step, is not acquired, or is frozen (its view has no gradient buffer).
  Status GradsReady(size_t chunk, TrainerStream stream = {});

  /// Finishes the optimizer step: completes when every chunk is updated (or the step was
  /// skipped for fp16 overflow) and its working parameters are where the next forward needs them.
  /// FailedPrecondition when a chunk received gradients in only some micro-steps, when none
  /// did, or while a chunk is acquired. On an error Step() may be called again to retry with
  /// the same gradients (see "Failures" at the top of this file for what a failure leaves).
  std::future<Result<StepReport>> Step();
  /// optimizer.recheck_gradients only: ends the open step keeping nothing of it — the gradients
  /// declared since the last Step() are dropped and every update made ahead of Step() is rolled
  /// back, as if backward had not run (torch's zero_grad() after a backward without step(): a
  /// skipped batch, or GradScaler skipping a step whose gradients overflowed). No step or
  /// iteration is counted and the loss scale stays. Blocks until done; OK at once when no
  /// gradients were declared. FailedPrecondition without optimizer.recheck_gradients (updates
  /// may already have been kept), while a step runs or a chunk is acquired, and after a failed
  /// Step() (retry it first).
  Status AbandonStep();

  /// Scale the trainer multiplies its loss by (fp16; 1 otherwise).
  double loss_scale() const;
  /// Optimizer steps taken (skipped ones do not count).
  int64_t step_count() const;
  /// Steps completed, skipped ones included: what a loop of N training iterations counts.
  int64_t iteration_count() const;
  /// Sets the learning rate (the base that each parameter's lr_scale multiplies) of the steps
  /// whose first GradsReady comes after this call: a step's hyper-parameters are fixed at its
  /// first GradsReady, so every chunk of a step is updated alike even though updates start
  /// during backward. A scheduler stepped after Step() (torch's order) sets the next step's.
  void SetLearningRate(double lr);
  /// Sets the optimizer steps taken so far (step_count(), and the step every chunk's bias
  /// correction counts from) to `steps`, for every trained chunk (frozen ones take no steps):
  /// what load_state_dict restores from another optimizer's state (torch.optim keeps a "step"
  /// per parameter). Between steps, with no chunk acquired; InvalidArgument outside [0, 2^53]
  /// (what a checkpoint holds). With several ranks a collective: every rank passes the same
  /// count (InvalidArgument on every rank otherwise).
  Status SetStepCount(int64_t steps);

  /// Writes a crash-consistent checkpoint of every tier into `dir` (replacing an existing one
  /// atomically). Must not be called while a step is running. ResourceExhausted, before writing,
  /// when the file system cannot hold it next to the previous one; FailedPrecondition when `dir`
  /// holds anything but a Strata checkpoint or nothing (Save never replaces what it did not
  /// write); any later error (a disk that filled meanwhile) names the size it needed. On any
  /// error the previous checkpoint is intact.
  Status Save(const std::filesystem::path& dir, const SaveOptions& save_options = {});
  /// What Save would refuse before writing, checked now without writing anything that stays,
  /// so that a trainer can fail before its first step rather than lose the run at its first
  /// save: `dir`'s parent must exist and be writable, what is at `dir` must be nothing, an
  /// empty directory or a Strata checkpoint and nothing else (Save never replaces anything
  /// else: FailedPrecondition naming what is there), and the file system must have room for
  /// this engine's checkpoint. Writes nothing but a scratch file in the parent, removed at once.
  /// With several ranks a collective, between steps: every rank checks, and all fail if one
  /// does (its error on that rank, Unavailable naming it on the others).
  Status CheckSaveTarget(const std::filesystem::path& dir) const;
  /// Loads a checkpoint written by Save, possibly with a different placement. DataLoss for a
  /// corrupted or incomplete checkpoint, or a manifest field missing, mistyped or out of range
  /// (the message names it); InvalidArgument when its parameters do not match the registered
  /// ones. On error the engine's state is unchanged.
  Status Load(const std::filesystem::path& dir);

  /// Copies the current fp32 master value of `parameter` (registration index) into `out`
  /// (numel floats). For tests, evaluation and export; blocks on NVMe reads. With several
  /// ranks a collective, as ReadParameterStates: every rank calls it alike.
  Status ReadMasterParameter(size_t parameter, std::span<float> out);
  /// Copies one of `parameter`'s optimizer states into `out` (numel floats), from whichever
  /// tier holds it: for a state_dict and export to other formats. Blocks on NVMe reads.
  /// FailedPrecondition while the parameter's chunk may be mid-update (see Acquire). A frozen
  /// parameter's kMaster is its working value in fp32; it has no moments (FailedPrecondition).
  Status ReadParameterState(size_t parameter, ParameterState state, std::span<float> out);
  /// Replaces one of `parameter`'s optimizer states with `values` (numel floats): for
  /// load_state_dict and import. Replacing the master also replaces the working parameters
  /// (rounded to the working dtype). Between steps only, with no chunk acquired; all or
  /// nothing (NVMe-home state goes through the shadow extents). A frozen parameter takes only
  /// kMaster, which sets its working value.
  Status WriteParameterState(size_t parameter, ParameterState state, std::span<const float> values);
  /// ReadParameterState for many states at once, each chunk's states read once: reading every
  /// parameter (a state_dict) costs one pass over the states, not one per parameter. All are
  /// checked before any is read; outputs are filled chunk by chunk (an error leaves the earlier
  /// chunks' filled), so they should not overlap.
  ///
  /// With several ranks, every state call (these, the single-parameter ones, SetStepCount) is a
  /// collective, as FSDP's full state_dict: every rank makes the same call with the same
  /// parameters and states in the same order (InvalidArgument on every rank, before anything
  /// is done, otherwise) and gets whole values, the shards gathered chunk by chunk; a write
  /// changes each rank's shard and rebuilds the working parameters from the gathered master.
  /// An error on one rank is every rank's, at the same chunk.
  Status ReadParameterStates(std::span<const ParameterStateRead> reads);
  /// WriteParameterState for many states at once, one read-modify-write per chunk (a
  /// load_state_dict). All are checked before any is written. Then chunk by chunk: an error
  /// reading a chunk or writing its NVMe home leaves that chunk as it was; an error writing a
  /// memory home (host or device, written in place) may leave that chunk partly written and
  /// says so. Either way the chunks before it hold the new values. Several entries for the same
  /// state: the last wins.
  Status WriteParameterStates(std::span<const ParameterStateWrite> writes);

  TierUsage tier_usage(Tier tier) const;
  EngineCounters counters() const;
  /// The engine's metrics (strata_* series), for the /metrics endpoint.
  MetricsRegistry& metrics();

  class Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::offload
