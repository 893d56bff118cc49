// `strata plan --measure`: the rates the offload engine achieves on this machine, for the step
// time prediction (step_plan.h). Not device peaks: host<->device copies of whole chunks
// (copy_bench.h's device), and the CPU optimizer and NVMe reads and writes of optimizer states
// with the engine's own optimizer, swap space and staging buffers, each alone, at its chunk size
// and staging concurrency (the pipeline benchmark's per-resource phase). Under a launcher with
// several ranks, the link too: the engine's reduce-scatter and all-gather of whole chunks across
// the ranks, on the communicator the engine would use.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/offload/communicator.h"
#include "strata/offload/step_plan.h"

namespace strata::tools {

struct MeasureSettings {
  std::string nvme_path;     ///< A directory on the drives the states would use.
  uint64_t chunk_bytes = 0;  ///< Working parameters per chunk, a multiple of 4 KiB.
  DType working_dtype = DType::kBf16;
  double params = 0.0;  ///< The model's size; at most 32Mi parameters of it are streamed.
  bool copies = true;   ///< Measure host<->device copies.
  bool states = true;   ///< Measure the CPU optimizer and NVMe state traffic.
  /// Several ranks: measure the link's collectives on it. Every rank calls MeasureRates with
  /// it, alike; the link rate is the slowest rank's.
  offload::Communicator* ranks = nullptr;
  /// One line before each measurement; may be empty.
  std::function<void(const std::string&)> progress;
};

/// Fills the asked rates (the link's with several ranks; never compute, which needs a model).
/// Errors: the benchmarks' (an NVMe path that is missing or full, a chunk size that is not
/// 4 KiB-aligned), a collective's (a rank that died or timed out).
Result<offload::MachineRates> MeasureRates(const MeasureSettings& settings);

}  // namespace strata::tools
