// Updater: the seam between a step and its arithmetic. The step pipeline decides when a chunk
// updates and moves its states and parameters (step/step_update.cpp); an Updater runs one
// optimizer step over the states it is handed. Today's is the vectorized CPU kernels
// (cpu_updater.h). An updater that keeps states on a GPU and steps them there is a new file
// beside it and a line in updaters.cpp's table; nothing in step/ changes.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "strata/core/device.h"
#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/core/tier.h"
#include "strata/offload/chunk_layout.h"

namespace strata::cpu_adam {
class CpuOptimizer;
}

namespace strata::offload {

/// One optimizer step over one chunk's states (this rank's shard of them).
struct ChunkUpdate {
  const OptimizerOptions* optimizer = nullptr;  ///< The rule and its fixed hyper-parameters.
  /// Runs of parameters sharing their group's settings, in the chunk's elements.
  std::span<const ChunkSegment> segments;
  size_t numel = 0;  ///< Elements updated: master | exp_avg | exp_avg_sq each hold this many.
  float* states = nullptr;
  /// Where the updated states go: `states` for an update in place. Out of place, a state the
  /// rule lacks (Lion's second moment, Adagrad's first) is left alone there.
  float* states_out = nullptr;
  const void* grads = nullptr;
  DType grad_dtype = DType::kFp32;
  /// The new working parameters, rounded from the new master (null: not wanted).
  void* param_copy = nullptr;
  DType working_dtype = DType::kFp32;
  double lr = 0.0;        ///< The step's base learning rate (segments scale it).
  int64_t step = 0;       ///< The chunk's update count after this one (bias correction).
  double grad_scale = 1;  ///< What the gradients are multiplied by first (unscale, clip).
};

class Updater {
 public:
  virtual ~Updater() = default;
  /// For messages: "cpu".
  virtual std::string name() const = 0;
  /// Whether Update queues its work on the device's compute stream (states in device memory,
  /// kernels on the device), which the pipeline then waits for; false: Update computes on the
  /// calling thread and returns when done (for host-kept states one of the engine's job
  /// threads; for device-kept ones the compute stream's host-function thread, in stream order).
  virtual bool queues_on_device() const = 0;
  virtual Status Update(const ChunkUpdate& update) = 0;
};

/// What an updater may be built from.
struct UpdaterContext {
  Device& device;
  /// The engine's CPU kernels (its oneTBB arena), which host-side work shares.
  cpu_adam::CpuOptimizer& cpu;
};

/// The engine's updaters: one for states kept in host memory or on NVMe (always), and one for
/// states kept in device memory where an updater serves this device (updaters.cpp).
class Updaters {
 public:
  /// The first registered updater serving each tier on `context.device`.
  static Result<Updaters> Create(const UpdaterContext& context);
  /// Unavailable naming the device unless an updater steps states kept in its memory: what the
  /// placement checks before it puts any there.
  static Status CheckDeviceStatesServed(const Device& device);

  Updater& host() { return *host_; }
  /// Null where no updater serves states in this device's memory (the placement put none).
  Updater* device() { return device_.get(); }

 private:
  std::unique_ptr<Updater> host_;
  std::unique_ptr<Updater> device_;
};

}  // namespace strata::offload
