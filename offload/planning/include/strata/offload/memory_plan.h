// MemoryPlan: per-GPU memory of model state under data parallelism, the ZeRO stages and the
// offload placements, before a run (what `strata plan` prints).
//
// Model state only (no activations, buffers or fragmentation), counted as in the ZeRO paper
// (Rajbhandari et al. 2020, section 3): with Psi parameters and N data-parallel GPUs, working
// parameters and gradients take w bytes each (2 for fp16/bf16, 4 for fp32) and the optimizer K
// bytes per parameter (mixed-precision Adam: fp32 master + exp_avg + exp_avg_sq = 12). Plain data
// parallelism keeps (2w + K) Psi per GPU; ZeRO-1 shards the optimizer states (2w Psi + K Psi / N),
// ZeRO-2 also the gradients (w Psi + (w + K) Psi / N), ZeRO-3 also the parameters
// ((2w + K) Psi / N). For 10e9 parameters on 8 GPUs with fp16 Adam: 160, 55, 37.5 and 20 GB.
//
// Offload moves a share to host memory or NVMe, as this engine places it: offloaded optimizer
// states leave the GPU (K Psi / N per GPU on the host or NVMe; the gradients a GPU reduces go
// to host memory to be stepped there, w Psi / N); offloaded parameters (ZeRO-3) live on the host
// or NVMe and visit the GPU a few chunks at a time (counted as 0 here).
//
// Communication per GPU per step, in elements of the working dtype: about 2 Psi for data
// parallelism, ZeRO-1 and ZeRO-2 (a reduce-scatter and an all-gather, or an all-reduce), 3 Psi for
// ZeRO-3 (parameters are all-gathered in forward and again in backward). ZeRO++ (Wang et al.
// 2023) quantizes ZeRO-3's: its 2 Psi of gathers move blockwise int8 (qwZ) and its Psi of
// gradient reduction blockwise int8 or int4 (qgZ), each block of 256 values with a 4-byte scale.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/core/tier.h"

namespace strata::offload {

struct PlanInput {
  double params = 0.0;  ///< Parameter count Psi, > 0.
  int gpus = 1;         ///< Data-parallel ranks N, >= 1.
  DType working_dtype = DType::kFp16;
  OptimizerType optimizer = OptimizerType::kAdamW;
  /// Gradient clipping by global norm (DeepSpeed's gradient_clipping); 0 = none. Clipping, like
  /// fp16's overflow check, needs every gradient before an update is final (step_plan.h).
  double gradient_clipping = 0.0;
  /// OptimizerOptions::speculative_updates: gated steps update during backward, as if nothing
  /// clips or overflows, and redo the rare step that does; false: they wait for backward.
  bool speculative_updates = true;
  /// OptimizerOptions::delayed_update: each step's update runs beside the next step's forward
  /// and backward, so it competes with the whole of compute, not only backward (step_plan.h).
  bool delayed_update = false;
  /// Working bytes per chunk (placement.chunk_bytes): how many chunks the states on NVMe make,
  /// and so how far the engine's staging buffers read them ahead of backward (step_plan.h).
  uint64_t chunk_bytes = EngineOptions().placement.chunk_bytes;
  /// ZeRO++ (placement.quantized_weights, quantized_gradients, quantized_gradient_bits): the
  /// bytes of ZeRO-3's collectives.
  bool quantized_weights = false;
  bool quantized_gradients = false;
  int quantized_gradient_bits = EngineOptions().placement.quantized_gradient_bits;

  Status Validate() const;
};

/// Bytes of each kind of state in one place.
struct StateBytes {
  double params = 0.0;
  double grads = 0.0;
  double optimizer_states = 0.0;
  double total() const { return params + grads + optimizer_states; }
};

/// One way to run: where each state lives and what a GPU holds of it.
struct PlanRow {
  std::string name;    ///< "data parallel", "ZeRO-2, optimizer -> host", ...
  int zero_stage = 0;  ///< 0 for plain data parallelism.
  Tier optimizer_states = Tier::kDevice;
  Tier params = Tier::kDevice;
  StateBytes device;        ///< Per GPU.
  StateBytes host;          ///< Per GPU's share of host memory.
  StateBytes nvme;          ///< Per GPU's share of NVMe.
  double comm_bytes = 0.0;  ///< Sent per GPU per step by the collectives.
};

/// Bytes per parameter of the optimizer's state with fp32 master weights (K): Adam/AdamW 12,
/// Adagrad and Lion 8. For fp32 training the master is the working copy: K - 4.
double OptimizerBytesPerParam(OptimizerType optimizer, DType working_dtype);

/// Data parallel, ZeRO-1, ZeRO-2, ZeRO-3, then the offload placements: ZeRO-2 with the optimizer
/// on host and on NVMe, ZeRO-3 with optimizer and parameters on host, with the optimizer on NVMe
/// and parameters on host (strata train's default), and with both on NVMe.
std::vector<PlanRow> PlanMemory(const PlanInput& input);

/// Of the node's host memory, the share a split placement fills with optimizer states; the rest
/// is left for the process, staging buffers and the page cache.
inline constexpr double kHostShareForStates = 0.9;

/// `row`, whose optimizer states are on NVMe, with as much of them as fits in the node's host
/// memory (`host_bytes`, kHostShareForStates of it, after what the row keeps there already)
/// moved there: what placement.max_states_in_host does, named "<row>, states split host + nvme".
/// Its host.optimizer_states is the max_states_in_host to run it with. nullopt unless some but
/// not all of the states fit (none: the NVMe row is it; all: the host row is).
std::optional<PlanRow> SplitStatesAcrossHostAndNvme(const PlanRow& row, int gpus,
                                                    double host_bytes);

}  // namespace strata::offload
