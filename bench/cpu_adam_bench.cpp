// Micro-benchmarks of the CPU optimizer kernels. Every optimizer configuration is paired with
// its roofline (the same byte streams, trivial arithmetic) at the same sizes, so the report
// carries its own reference: compare bytes_per_second of BM_Step/... with BM_Roofline/...
// Sizes sweep from cache-resident to far beyond the last-level cache.
//
//   cpu_adam_bench --benchmark_filter='adamw_fp32' --benchmark_repetitions=3
#include <benchmark/benchmark.h>

#include <cstdio>
#include <optional>
#include <string>

#include "strata/core/aligned_buffer.h"
#include "strata/cpu_adam/adam_benchmark.h"
#include "strata/cpu_adam/cpu_optimizer.h"

namespace strata::cpu_adam {
namespace {

struct Config {
  OptimizerType optimizer;
  DType grad_dtype;
  DType state_dtype;
  std::optional<DType> param_copy_dtype;
};

CpuOptimizer& SharedOptimizer() {
  static CpuOptimizer optimizer = [] {
    auto created = CpuOptimizer::Create();
    if (!created.ok()) {
      std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
      std::abort();
    }
    return std::move(*created);
  }();
  return optimizer;
}

/// The arrays of one configuration, allocated and first-touched by the optimizer's threads.
struct Arrays {
  AlignedBuffer params, grads, exp_avg, exp_avg_sq, param_copy;
  StepBuffers buffers;

  Arrays(const Config& c, size_t n) {
    auto allocate = [](size_t bytes) {
      auto buffer = AlignedBuffer::Allocate(bytes);
      if (!buffer.ok()) std::abort();
      return std::move(*buffer);
    };
    params = allocate(n * 4);
    grads = allocate(n * DTypeSize(c.grad_dtype));
    exp_avg = allocate(n * DTypeSize(c.state_dtype));
    exp_avg_sq = allocate(n * DTypeSize(c.state_dtype));
    if (c.param_copy_dtype) param_copy = allocate(n * 2);
    buffers = {.numel = n,
               .params = reinterpret_cast<float*>(params.data()),
               .grads = grads.data(),
               .grad_dtype = c.grad_dtype,
               .exp_avg = exp_avg.data(),
               .exp_avg_sq = exp_avg_sq.data(),
               .state_dtype = c.state_dtype,
               .param_copy = c.param_copy_dtype ? param_copy.data() : nullptr,
               .param_copy_dtype = c.param_copy_dtype.value_or(DType::kBf16)};
    CpuOptimizer& optimizer = SharedOptimizer();
    (void)optimizer.Fill(buffers.params, DType::kFp32, n, 0.5f).ok();
    (void)optimizer.Fill(grads.data(), c.grad_dtype, n, 1e-3f).ok();
    (void)optimizer.Fill(buffers.exp_avg, c.state_dtype, n, 0.0f).ok();
    (void)optimizer.Fill(buffers.exp_avg_sq, c.state_dtype, n, 0.0f).ok();
    if (c.param_copy_dtype) (void)optimizer.Fill(param_copy.data(), *c.param_copy_dtype, n, 0).ok();
  }
};

Status Step(CpuOptimizer& optimizer, OptimizerType type, const StepBuffers& buffers, int64_t t) {
  switch (type) {
    case OptimizerType::kAdamW: return optimizer.Step(AdamWHyperParams{.step = t}, buffers);
    case OptimizerType::kAdam: return optimizer.Step(AdamHyperParams{.step = t}, buffers);
    case OptimizerType::kAdagrad: return optimizer.Step(AdagradHyperParams{.step = t}, buffers);
    case OptimizerType::kLion: return optimizer.Step(LionHyperParams{}, buffers);
  }
  return Internal("unknown optimizer");
}

void Run(benchmark::State& state, const Config& config, bool roofline) {
  const auto n = static_cast<size_t>(state.range(0));
  Arrays arrays(config, n);
  CpuOptimizer& optimizer = SharedOptimizer();
  int64_t t = 0;
  for (auto _ : state) {
    const Status status = roofline ? optimizer.RooflineStep(config.optimizer, arrays.buffers)
                                   : Step(optimizer, config.optimizer, arrays.buffers, ++t);
    if (!status.ok()) state.SkipWithError(status.ToString().c_str());
  }
  const size_t bytes_per_param = BytesPerParam(config.optimizer, config.grad_dtype,
                                               config.state_dtype, config.param_copy_dtype);
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(n));
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(n * bytes_per_param));
  state.SetLabel(std::string(SimdLevelName(optimizer.simd_level())) + ", " +
                 std::to_string(optimizer.threads()) + " threads, " +
                 std::to_string(bytes_per_param) + " B/param");
}

void RegisterPair(const std::string& name, const Config& config) {
  for (bool roofline : {false, true}) {
    benchmark::RegisterBenchmark(
        ((roofline ? "BM_Roofline/" : "BM_Step/") + name).c_str(),
        [config, roofline](benchmark::State& state) { Run(state, config, roofline); })
        ->RangeMultiplier(16)
        ->Range(1 << 12, 1 << 24)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
}

void BM_GradientStats(benchmark::State& state) {
  const auto n = static_cast<size_t>(state.range(0));
  const auto dtype = static_cast<DType>(state.range(1));
  auto grads = AlignedBuffer::Allocate(n * DTypeSize(dtype));
  if (!grads.ok()) std::abort();
  CpuOptimizer& optimizer = SharedOptimizer();
  (void)optimizer.Fill(grads->data(), dtype, n, 1e-3f).ok();
  for (auto _ : state) {
    auto stats = optimizer.ComputeGradientStats(grads->data(), dtype, n);
    benchmark::DoNotOptimize(stats);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(n));
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(n * DTypeSize(dtype)));
}
BENCHMARK(BM_GradientStats)
    ->ArgsProduct({benchmark::CreateRange(1 << 12, 1 << 24, 16), {0, 2}})  // fp32, bf16.
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

const bool kRegistered = [] {
  RegisterPair("adamw_fp32", {OptimizerType::kAdamW, DType::kFp32, DType::kFp32, std::nullopt});
  RegisterPair("adamw_bf16grad_bf16copy",
               {OptimizerType::kAdamW, DType::kBf16, DType::kFp32, DType::kBf16});
  RegisterPair("adamw_fp16grad_fp16copy",
               {OptimizerType::kAdamW, DType::kFp16, DType::kFp32, DType::kFp16});
  RegisterPair("adamw_bf16states",
               {OptimizerType::kAdamW, DType::kFp32, DType::kBf16, std::nullopt});
  RegisterPair("adagrad_fp32", {OptimizerType::kAdagrad, DType::kFp32, DType::kFp32, std::nullopt});
  RegisterPair("lion_fp32", {OptimizerType::kLion, DType::kFp32, DType::kFp32, std::nullopt});
  return true;
}();

}  // namespace
}  // namespace strata::cpu_adam

BENCHMARK_MAIN();
