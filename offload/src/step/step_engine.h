// StepEngine: what the step pipeline uses of the engine, and nothing else. Engine::Impl
// implements it; the pipeline holds a StepEngine& and includes this header, not engine_impl.h,
// so the engine's placement, checkpoints and state access are out of its reach, and a change
// there recompiles none of the step's files.
//
// Two kinds of thing: the engine's configuration as the step sees it (fixed once the engine is
// placed), and the parts and resources the step drives (each still owned by the engine: the
// chunks' storage, the device, the residency, the reduce ring, the loop, the job threads, the
// NVMe swap space and staging, the CPU kernels and the updaters, the metrics).
#pragma once

#include <vector>

#include "engine/chunk.h"
#include "engine/engine_metrics.h"
#include "engine/loop_sync.h"
#include "residency/residency.h"
#include "sharding/reduce_ring.h"
#include "strata/core/event_loop.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "strata/nvme/swap_space.h"
#include "strata/offload/communicator.h"
#include "update/updater.h"

namespace strata::offload {

class StepEngine {
 public:
  // --- The configuration (Engine::Impl documents each) ---
  virtual int rank() const = 0;
  virtual int ranks() const = 0;
  virtual bool sharded() const = 0;
  virtual bool gathers_params() const = 0;
  virtual bool reduces_from_ring() const = 0;
  virtual bool reduces_each_micro_step() const = 0;
  virtual bool sums_micro_steps() const = 0;
  virtual bool quantizes_gradients() const = 0;
  virtual int gradient_quant_bits() const = 0;
  virtual bool ZeroCopy(const Chunk& c) const = 0;
  virtual DType working_dtype() const = 0;
  virtual size_t working_size() const = 0;
  virtual bool Speculates() const = 0;
  /// A state or parameter home is on NVMe: a step can fail after its updates, so device-kept
  /// states, stepped in place with nothing to undo them by, update at the commit.
  virtual bool transactional() const = 0;

  // --- What the step drives ---
  virtual std::vector<Chunk>& chunks() = 0;
  virtual Device& device() = 0;
  virtual Residency& residency() = 0;
  virtual ReduceRing& reduce_ring() = 0;
  /// Several ranks' collectives (one rank's own communicator otherwise).
  virtual Communicator& communicator() = 0;
  /// Null without NVMe homes.
  virtual nvme::SwapSpace* swap() = 0;
  /// Offloaded parameters' NVMe staging; null without NVMe-home parameters.
  virtual LoopStagingPool* param_staging() = 0;
  /// Re-recorded by each GradsReady on the trainer's stream (trainer thread).
  virtual DeviceEvent& compute_marker() = 0;
  /// The CPU's kernels: gradient sums, norms, checksums, quantization on host memory.
  virtual cpu_adam::CpuOptimizer& cpu() = 0;
  virtual Updaters& updaters() = 0;
  virtual EngineMetrics& metrics() = 0;
  virtual EventLoop& loop() = 0;
  virtual JobThreads& jobs() = 0;
  /// Every job the step awaits counts here (the engine's destructor waits for them).
  virtual JobCounter& jobs_in_flight() = 0;
  /// Starts `work` on the event loop, counted until it finishes.
  virtual void Spawn(Awaitable<void> work) = 0;

  virtual ~StepEngine() = default;
};

}  // namespace strata::offload
