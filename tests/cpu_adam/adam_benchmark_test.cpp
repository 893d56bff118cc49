// The benchmark's bookkeeping (not its timings: those belong to `strata bench adam`).
#include "strata/cpu_adam/adam_benchmark.h"

#include <gtest/gtest.h>

namespace strata::cpu_adam {
namespace {

TEST(AdamBenchmarkTest, BytesPerParamFollowsPerformanceMd) {
  EXPECT_EQ(BytesPerParam(OptimizerType::kAdamW, DType::kFp32, DType::kFp32, std::nullopt), 28u);
  EXPECT_EQ(BytesPerParam(OptimizerType::kAdamW, DType::kFp32, DType::kFp32, DType::kBf16), 30u);
  EXPECT_EQ(BytesPerParam(OptimizerType::kAdamW, DType::kBf16, DType::kFp32, std::nullopt), 26u);
  EXPECT_EQ(BytesPerParam(OptimizerType::kAdamW, DType::kBf16, DType::kFp32, DType::kBf16), 28u);
  EXPECT_EQ(BytesPerParam(OptimizerType::kAdam, DType::kFp32, DType::kBf16, std::nullopt), 20u);
  EXPECT_EQ(BytesPerParam(OptimizerType::kAdagrad, DType::kFp32, DType::kFp32, std::nullopt), 20u);
  EXPECT_EQ(BytesPerParam(OptimizerType::kLion, DType::kFp16, DType::kFp32, DType::kFp16), 20u);
}

TEST(AdamBenchmarkTest, MedianOfOddAndEvenCounts) {
  EXPECT_EQ(Median({}), 0.0);
  EXPECT_EQ(Median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_EQ(Median({4.0, 1.0, 3.0, 2.0}), 2.5);
}

TEST(AdamBenchmarkTest, SmallRunReportsConsistentFigures) {
  for (OptimizerType type :
       {OptimizerType::kAdamW, OptimizerType::kAdagrad, OptimizerType::kLion}) {
    auto result = RunAdamBenchmark({.optimizer = type,
                                    .numel = 100'003,
                                    .grad_dtype = DType::kBf16,
                                    .param_copy_dtype = DType::kBf16,
                                    .threads = 2,
                                    .warmup_runs = 1,
                                    .timed_runs = 3});
    ASSERT_TRUE(result.ok()) << result.status().ToString();
    EXPECT_EQ(result->numel, 100'003u);
    EXPECT_EQ(result->threads, 2);
    EXPECT_EQ(result->step_seconds.size(), 3u);
    EXPECT_EQ(result->roofline_seconds.size(), 3u);
    EXPECT_GT(result->params_per_second, 0);
    EXPECT_DOUBLE_EQ(result->bytes_per_second,
                     result->params_per_second * static_cast<double>(result->bytes_per_param));
    EXPECT_DOUBLE_EQ(result->ratio, result->params_per_second / result->roofline_params_per_second);
    if (result->simd_level != SimdLevel::kScalar) {
      EXPECT_EQ(result->roofline_simd_level, result->simd_level);
    }
  }
}

TEST(AdamBenchmarkTest, ScalarStepIsComparedWithTheBestRoofline) {
  auto result = RunAdamBenchmark(
      {.numel = 5000, .simd = SimdLevel::kScalar, .warmup_runs = 0, .timed_runs = 1});
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->simd_level, SimdLevel::kScalar);
  EXPECT_EQ(result->roofline_simd_level, BestSupportedSimdLevel());
}

TEST(AdamBenchmarkTest, RejectsImpossibleOptions) {
  EXPECT_EQ(RunAdamBenchmark({.numel = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(RunAdamBenchmark({.numel = 10, .state_dtype = DType::kFp16}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(RunAdamBenchmark({.numel = 10, .param_copy_dtype = DType::kFp32}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(RunAdamBenchmark({.numel = 10, .timed_runs = 0}).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::cpu_adam
