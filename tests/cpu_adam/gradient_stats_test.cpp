#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "strata/cpu_adam/cpu_optimizer.h"
#include "test_arrays.h"

namespace strata::cpu_adam {
namespace {

using testing::GuardedArray;
using testing::SupportedLevels;

GuardedArray RandomGradients(DType dtype, size_t n, size_t offset, uint32_t seed) {
  GuardedArray grads(dtype, n, offset);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) grads.Set(i, normal(rng));
  return grads;
}

double ExactSumOfSquares(const GuardedArray& grads) {
  long double sum = 0;
  for (size_t i = 0; i < grads.numel(); ++i) {
    const long double g = grads.Get(i);
    sum += g * g;
  }
  return static_cast<double>(sum);
}

TEST(GradientStatsTest, SumOfSquaresMatchesAnExactSumForEveryLevelAndDtype) {
  for (SimdLevel level : SupportedLevels()) {
    auto optimizer = CpuOptimizer::Create({.threads = 2, .simd = level});
    ASSERT_TRUE(optimizer.ok());
    for (DType dtype : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      for (size_t n : {size_t{1}, size_t{15}, size_t{33}, size_t{1000}, 3 * kBlockElements + 5}) {
        const GuardedArray grads = RandomGradients(dtype, n, 1, static_cast<uint32_t>(n));
        auto stats = optimizer->ComputeGradientStats(grads.data(), dtype, n);
        ASSERT_TRUE(stats.ok());
        // Squares are exact in double; only the additions round (relative 1e-16 each).
        EXPECT_NEAR(stats->sum_of_squares, ExactSumOfSquares(grads),
                    1e-12 * ExactSumOfSquares(grads))
            << SimdLevelName(level) << " " << DTypeName(dtype) << " n=" << n;
        EXPECT_TRUE(stats->all_finite);
      }
    }
  }
}

TEST(GradientStatsTest, ResultIsIdenticalForAnyThreadCount) {
  const size_t n = 7 * kBlockElements + 123;
  const GuardedArray grads = RandomGradients(DType::kFp32, n, 0, 42);
  for (SimdLevel level : SupportedLevels()) {
    auto single = CpuOptimizer::Create({.threads = 1, .simd = level});
    ASSERT_TRUE(single.ok());
    const auto expected = single->ComputeGradientStats(grads.data(), DType::kFp32, n);
    ASSERT_TRUE(expected.ok());
    for (int threads : {2, 3, 5, 8}) {
      auto optimizer = CpuOptimizer::Create({.threads = threads, .simd = level});
      ASSERT_TRUE(optimizer.ok());
      const auto stats = optimizer->ComputeGradientStats(grads.data(), DType::kFp32, n);
      ASSERT_TRUE(stats.ok());
      EXPECT_EQ(stats->sum_of_squares, expected->sum_of_squares)  // Bit for bit.
          << SimdLevelName(level) << " with " << threads << " threads";
    }
  }
}

TEST(GradientStatsTest, FindsInfAndNanAnywhere) {
  const float kValues[] = {std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN()};
  for (SimdLevel level : SupportedLevels()) {
    auto optimizer = CpuOptimizer::Create({.threads = 2, .simd = level});
    ASSERT_TRUE(optimizer.ok());
    for (DType dtype : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      const size_t n = kBlockElements + 37;
      for (size_t position : {size_t{0}, size_t{17}, kBlockElements - 1, n - 1}) {
        for (float bad : kValues) {
          GuardedArray grads = RandomGradients(dtype, n, 3, 1);
          grads.Set(position, bad);
          auto stats = optimizer->ComputeGradientStats(grads.data(), dtype, n);
          ASSERT_TRUE(stats.ok());
          EXPECT_FALSE(stats->all_finite) << SimdLevelName(level) << " " << DTypeName(dtype) << " "
                                          << bad << " at " << position;
        }
      }
    }
  }
}

TEST(GradientStatsTest, Fp16OverflowIsNonFiniteButItsLargestValueIsNot) {
  auto optimizer = CpuOptimizer::Create();
  ASSERT_TRUE(optimizer.ok());
  std::vector<uint16_t> grads(100, Fp32ToFp16(1.0f));
  grads[50] = Fp32ToFp16(65504.0f);  // The largest finite fp16.
  auto stats = optimizer->ComputeGradientStats(grads.data(), DType::kFp16, grads.size());
  ASSERT_TRUE(stats.ok());
  EXPECT_TRUE(stats->all_finite);
  EXPECT_EQ(stats->sum_of_squares, 99.0 + 65504.0 * 65504.0);
  grads[50] = Fp32ToFp16(70000.0f);  // Rounds to Inf.
  stats = optimizer->ComputeGradientStats(grads.data(), DType::kFp16, grads.size());
  ASSERT_TRUE(stats.ok());
  EXPECT_FALSE(stats->all_finite);
}

TEST(GradientStatsTest, EmptyAndInvalidInputs) {
  auto optimizer = CpuOptimizer::Create();
  ASSERT_TRUE(optimizer.ok());
  auto empty = optimizer->ComputeGradientStats(nullptr, DType::kFp32, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->sum_of_squares, 0.0);
  EXPECT_TRUE(empty->all_finite);
  EXPECT_EQ(optimizer->ComputeGradientStats(nullptr, DType::kFp32, 4).status().code(),
            StatusCode::kInvalidArgument);
  alignas(4) uint8_t bytes[16] = {};
  EXPECT_EQ(optimizer->ComputeGradientStats(bytes + 1, DType::kFp32, 2).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::cpu_adam
