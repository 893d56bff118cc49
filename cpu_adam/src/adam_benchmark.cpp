#include "strata/cpu_adam/adam_benchmark.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>

#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"
#include "strata/cpu_adam/cpu_optimizer.h"

namespace strata::cpu_adam {
namespace {

// Writes `numel` elements of a deterministic pattern into `data`, in the optimizer's threads.
// `scale` sets the magnitude; the pattern mixes signs so the optimizer does real work.
void FillPattern(CpuOptimizer& optimizer, void* data, DType dtype, size_t numel, float offset,
                 float scale) {
  optimizer.ParallelFor(numel, [=](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const auto hashed = static_cast<uint32_t>(i * 2654435761u) >> 20;  // 0..4095
      const float value = offset + scale * (static_cast<float>(hashed) / 2048.0f - 1.0f);
      switch (dtype) {
        case DType::kFp32: static_cast<float*>(data)[i] = value; break;
        case DType::kFp16: static_cast<uint16_t*>(data)[i] = Fp32ToFp16(value); break;
        case DType::kBf16: static_cast<uint16_t*>(data)[i] = Fp32ToBf16(value); break;
      }
    }
  });
}

Status StepOnce(CpuOptimizer& optimizer, OptimizerType type, const StepBuffers& buffers,
                int64_t step) {
  switch (type) {
    case OptimizerType::kAdamW: return optimizer.Step(AdamWHyperParams{.step = step}, buffers);
    case OptimizerType::kAdam: return optimizer.Step(AdamHyperParams{.step = step}, buffers);
    case OptimizerType::kAdagrad: return optimizer.Step(AdagradHyperParams{.step = step}, buffers);
    case OptimizerType::kLion: return optimizer.Step(LionHyperParams{}, buffers);
  }
  return Internal("unknown optimizer type");
}

template <typename Fn>
Result<double> TimeSeconds(const Fn& fn) {
  const auto start = std::chrono::steady_clock::now();
  STRATA_RETURN_IF_ERROR(fn());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

Status AdamBenchmarkOptions::Validate() const {
  if (numel == 0) return InvalidArgument("bench adam: numel must be >= 1");
  if (state_dtype != DType::kFp32 && state_dtype != DType::kBf16) {
    return InvalidArgument("bench adam: state dtype must be fp32 or bf16, got " +
                           std::string(DTypeName(state_dtype)));
  }
  if (param_copy_dtype == DType::kFp32) {
    return InvalidArgument("bench adam: the parameter copy must be fp16 or bf16 (or none)");
  }
  if (threads < 0) return InvalidArgument("bench adam: threads must be >= 0 (0 = all)");
  if (warmup_runs < 0) return InvalidArgument("bench adam: warm-up runs must be >= 0");
  if (timed_runs < 1) return InvalidArgument("bench adam: timed runs must be >= 1");
  return Status::Ok();
}

size_t BytesPerParam(OptimizerType optimizer, DType grad_dtype, DType state_dtype,
                     std::optional<DType> param_copy_dtype) {
  size_t bytes = 2 * sizeof(float) + DTypeSize(grad_dtype);
  if (UsesExpAvg(optimizer)) bytes += 2 * DTypeSize(state_dtype);
  if (UsesExpAvgSq(optimizer)) bytes += 2 * DTypeSize(state_dtype);
  if (param_copy_dtype.has_value()) bytes += DTypeSize(*param_copy_dtype);
  return bytes;
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

Result<AdamBenchmarkResult> RunAdamBenchmark(const AdamBenchmarkOptions& options) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  STRATA_ASSIGN_OR_RETURN(CpuOptimizer optimizer,
                          CpuOptimizer::Create({.threads = options.threads, .simd = options.simd}));
  // The roofline shares the step's arena unless the step is scalar.
  std::optional<CpuOptimizer> separate_roofline;
  if (optimizer.simd_level() == SimdLevel::kScalar &&
      BestSupportedSimdLevel() != SimdLevel::kScalar) {
    STRATA_ASSIGN_OR_RETURN(
        separate_roofline,
        CpuOptimizer::Create({.threads = optimizer.threads(), .simd = BestSupportedSimdLevel()}));
  }
  CpuOptimizer& roofline = separate_roofline.has_value() ? *separate_roofline : optimizer;

  const size_t n = options.numel;
  const DType state = options.state_dtype;
  auto allocate = [n](DType dtype, bool used) -> Result<AlignedBuffer> {
    if (!used) return AlignedBuffer();
    auto buffer = AlignedBuffer::Allocate(n * DTypeSize(dtype));
    if (!buffer.ok()) return buffer.status().WithContext("bench adam");
    return buffer;
  };
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer params, allocate(DType::kFp32, true));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer grads, allocate(options.grad_dtype, true));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer exp_avg, allocate(state, UsesExpAvg(options.optimizer)));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer exp_avg_sq,
                          allocate(state, UsesExpAvgSq(options.optimizer)));
  const bool copy = options.param_copy_dtype.has_value();
  const DType copy_dtype = options.param_copy_dtype.value_or(DType::kBf16);
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer param_copy, allocate(copy_dtype, copy));

  const StepBuffers buffers = {
      .numel = n,
      .params = reinterpret_cast<float*>(params.data()),
      .grads = grads.data(),
      .grad_dtype = options.grad_dtype,
      .exp_avg = exp_avg.empty() ? nullptr : exp_avg.data(),
      .exp_avg_sq = exp_avg_sq.empty() ? nullptr : exp_avg_sq.data(),
      .state_dtype = state,
      .param_copy = copy ? param_copy.data() : nullptr,
      .param_copy_dtype = copy_dtype,
  };
  // First touch, by the threads that will run the step.
  FillPattern(optimizer, buffers.params, DType::kFp32, n, 0.0f, 1.0f);
  FillPattern(optimizer, grads.data(), options.grad_dtype, n, 0.0f, 1e-2f);
  if (buffers.exp_avg != nullptr)
    STRATA_RETURN_IF_ERROR(optimizer.Fill(buffers.exp_avg, state, n, 0));
  if (buffers.exp_avg_sq != nullptr) {
    STRATA_RETURN_IF_ERROR(optimizer.Fill(buffers.exp_avg_sq, state, n, 0));
  }
  if (copy) STRATA_RETURN_IF_ERROR(optimizer.Fill(buffers.param_copy, copy_dtype, n, 0));

  AdamBenchmarkResult result;
  result.simd_level = optimizer.simd_level();
  result.roofline_simd_level = roofline.simd_level();
  result.threads = optimizer.threads();
  result.numel = n;
  result.bytes_per_param =
      BytesPerParam(options.optimizer, options.grad_dtype, state, options.param_copy_dtype);
  int64_t step = 0;
  for (int run = 0; run < options.warmup_runs + options.timed_runs; ++run) {
    STRATA_ASSIGN_OR_RETURN(const double step_seconds, TimeSeconds([&] {
                              return StepOnce(optimizer, options.optimizer, buffers, ++step);
                            }));
    STRATA_ASSIGN_OR_RETURN(const double roofline_seconds, TimeSeconds([&] {
                              return roofline.RooflineStep(options.optimizer, buffers);
                            }));
    if (run < options.warmup_runs) continue;
    result.step_seconds.push_back(step_seconds);
    result.roofline_seconds.push_back(roofline_seconds);
  }
  result.step_median_seconds = Median(result.step_seconds);
  result.roofline_median_seconds = Median(result.roofline_seconds);
  const auto numel = static_cast<double>(n);
  result.params_per_second = numel / result.step_median_seconds;
  result.bytes_per_second = result.params_per_second * static_cast<double>(result.bytes_per_param);
  result.roofline_params_per_second = numel / result.roofline_median_seconds;
  result.roofline_bytes_per_second =
      result.roofline_params_per_second * static_cast<double>(result.bytes_per_param);
  result.ratio = result.params_per_second / result.roofline_params_per_second;
  return result;
}

}  // namespace strata::cpu_adam
