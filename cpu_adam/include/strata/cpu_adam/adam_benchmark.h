// The measurement behind `strata bench adam`: an optimizer step against its memory-bandwidth
// roofline, measured in the same run (PERFORMANCE.md).
//
// The roofline is CpuOptimizer::RooflineStep: a trivial kernel over the same arrays, reading and
// writing the same byte streams with the same threads, partitioning and vector width. Arrays are
// first touched by the threads that use them; after warm-up runs, step and roofline runs
// alternate so both face the same machine, and the medians are compared.
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/simd.h"

namespace strata::cpu_adam {

struct AdamBenchmarkOptions {
  /// The optimizer stepped (with its default hyper-parameters).
  OptimizerType optimizer = OptimizerType::kAdamW;
  /// Parameters per step; >= 1. Keep every array far larger than the last-level cache.
  size_t numel = size_t{256} << 20;
  /// fp32, fp16 or bf16.
  DType grad_dtype = DType::kFp32;
  /// fp32 or bf16.
  DType state_dtype = DType::kFp32;
  /// fp16 or bf16 to write a parameter copy; nullopt for none.
  std::optional<DType> param_copy_dtype = std::nullopt;
  /// Threads; 0 = all hardware threads.
  int threads = 0;
  /// Kernel build of the step; nullopt = as CpuOptimizerOptions::simd. The roofline runs at the
  /// same level, except that a scalar step is compared with the best SIMD roofline (a scalar
  /// loop is not a bandwidth limit).
  std::optional<SimdLevel> simd = std::nullopt;
  /// Untimed runs of each kernel first; >= 0.
  int warmup_runs = 1;
  /// Timed runs of each kernel; >= 1. Medians are reported.
  int timed_runs = 5;

  /// InvalidArgument naming the field for impossible values.
  Status Validate() const;
};

/// Bytes one step moves per parameter, counted as PERFORMANCE.md does: params read and written
/// (8), the gradient read (its size), each state read and written (twice its size), and the
/// copy written (2). AdamW with fp32 everything: 28.
size_t BytesPerParam(OptimizerType optimizer, DType grad_dtype, DType state_dtype,
                     std::optional<DType> param_copy_dtype);

struct AdamBenchmarkResult {
  SimdLevel simd_level = SimdLevel::kScalar;           ///< Of the step.
  SimdLevel roofline_simd_level = SimdLevel::kScalar;  ///< Of the roofline.
  int threads = 0;
  size_t numel = 0;
  size_t bytes_per_param = 0;
  std::vector<double> step_seconds;      ///< Each timed run, in order.
  std::vector<double> roofline_seconds;  ///< Each timed run, in order.
  double step_median_seconds = 0;
  double roofline_median_seconds = 0;
  double params_per_second = 0;           ///< numel / step_median_seconds.
  double bytes_per_second = 0;            ///< params_per_second * bytes_per_param.
  double roofline_params_per_second = 0;  ///< numel / roofline_median_seconds.
  double roofline_bytes_per_second = 0;
  /// params_per_second / roofline_params_per_second: 1 means at the bandwidth limit.
  double ratio = 0;
};

/// Allocates the arrays, runs the benchmark and frees them. Blocks for the whole run (seconds
/// for the default size). Errors: InvalidArgument for bad options, Unavailable for an
/// unsupported SIMD level, ResourceExhausted when the arrays do not fit in memory.
Result<AdamBenchmarkResult> RunAdamBenchmark(const AdamBenchmarkOptions& options);

/// The median of `values` (the mean of the middle two for an even count); 0 for none.
double Median(std::vector<double> values);

}  // namespace strata::cpu_adam
