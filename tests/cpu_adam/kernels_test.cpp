// Every SIMD build against the scalar reference, for every optimizer and dtype combination, at
// odd lengths and unaligned starts; plus the properties that must hold exactly for every build.
#include <gtest/gtest.h>

#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "strata/cpu_adam/cpu_optimizer.h"
#include "test_arrays.h"

namespace strata::cpu_adam {
namespace {

using testing::Difference;
using testing::MaxRelativeDifference;
using testing::StepArrays;

// Bounds on the largest relative difference (see MaxRelativeDifference) between a SIMD build and
// the reference after one step from the same inputs. fp32 results differ only by rounding: the
// SIMD builds fuse multiply-adds and multiply by 1/sqrt(1 - beta2^t) instead of dividing, a few
// units in the last place (2^-23 = 1.2e-7) each. A value rounded to 16 bits can then land on the
// neighbouring 16-bit value: one unit in the last place, at most 2^-7 of the value for bf16 and
// 2^-10 for fp16.
constexpr double kFp32Bound = 1e-6;
constexpr double kBf16Bound = 1.0 / 128;
constexpr double kFp16Bound = 1.0 / 1024;

double BoundFor(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return kFp32Bound;
    case DType::kFp16: return kFp16Bound;
    case DType::kBf16: return kBf16Bound;
  }
  return 0;
}

// Lengths around the vector widths (8, 16), the unrolled reduction (32) and a block boundary.
const size_t kLengths[] = {1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1001, kBlockElements + 77};
const size_t kOffsets[] = {0, 1, 5};

std::string SimdName(SimdLevel level) { return std::string(SimdLevelName(level)); }

/// Runs one step of `type` with typical hyper-parameters.
Status RunStep(CpuOptimizer& optimizer, OptimizerType type, const StepBuffers& buffers) {
  switch (type) {
    case OptimizerType::kAdamW:
      return optimizer.Step(
          AdamWHyperParams{.lr = 1e-3, .weight_decay = 0.01, .step = 10, .grad_scale = 0.5},
          buffers);
    case OptimizerType::kAdam:
      return optimizer.Step(
          AdamHyperParams{.lr = 1e-3, .weight_decay = 0.01, .step = 10, .grad_scale = 0.5},
          buffers);
    case OptimizerType::kAdagrad:
      return optimizer.Step(
          AdagradHyperParams{
              .lr = 1e-2, .lr_decay = 0.01, .weight_decay = 0.01, .step = 5, .grad_scale = 0.5},
          buffers);
    case OptimizerType::kLion:
      return optimizer.Step(LionHyperParams{.lr = 1e-4, .weight_decay = 0.1, .grad_scale = 0.5},
                            buffers);
  }
  return Internal("unknown optimizer");
}

const OptimizerType kOptimizers[] = {OptimizerType::kAdamW, OptimizerType::kAdam,
                                     OptimizerType::kAdagrad, OptimizerType::kLion};
const DType kGradTypes[] = {DType::kFp32, DType::kFp16, DType::kBf16};
const DType kStateTypes[] = {DType::kFp32, DType::kBf16};
const std::optional<DType> kCopyTypes[] = {std::nullopt, DType::kFp16, DType::kBf16};

class SimdVsReferenceTest : public ::testing::TestWithParam<std::tuple<SimdLevel, OptimizerType>> {
};

TEST_P(SimdVsReferenceTest, EveryDtypeCombinationMatchesWithinBounds) {
  const auto [level, type] = GetParam();
  if (!SimdLevelSupported(level, DetectCpuFeatures())) {
    GTEST_SKIP() << "this CPU cannot run " << SimdName(level) << " ("
                 << CpuFeaturesString(DetectCpuFeatures()) << ")";
  }
  auto simd = CpuOptimizer::Create({.threads = 2, .simd = level});
  auto reference = CpuOptimizer::Create({.threads = 1, .simd = SimdLevel::kScalar});
  ASSERT_TRUE(simd.ok() && reference.ok());

  for (DType grad : kGradTypes) {
    for (DType state : kStateTypes) {
      for (std::optional<DType> copy : kCopyTypes) {
        Difference params, exp_avg, exp_avg_sq, param_copy;
        for (size_t n : kLengths) {
          for (size_t offset : kOffsets) {
            const auto seed = static_cast<uint32_t>(n * 31 + offset);
            StepArrays actual(n, grad, state, copy, offset, seed);
            StepArrays expected(n, grad, state, copy, offset, seed);
            ASSERT_TRUE(RunStep(*simd, type, actual.buffers()).ok());
            ASSERT_TRUE(RunStep(*reference, type, expected.buffers()).ok());
            ASSERT_TRUE(actual.GuardsIntact()) << "wrote outside the arrays, n=" << n;
            auto keep_worst = [](Difference& worst, Difference d) {
              if (d.relative > worst.relative) worst = d;
            };
            keep_worst(params, MaxRelativeDifference(actual.params, expected.params));
            keep_worst(exp_avg, MaxRelativeDifference(actual.exp_avg, expected.exp_avg));
            keep_worst(exp_avg_sq, MaxRelativeDifference(actual.exp_avg_sq, expected.exp_avg_sq));
            if (copy) {
              keep_worst(param_copy, MaxRelativeDifference(actual.param_copy, expected.param_copy));
            }
          }
        }
        const std::string what = std::string(OptimizerTypeName(type)) + " " + SimdName(level) +
                                 " grads " + std::string(DTypeName(grad)) + ", states " +
                                 std::string(DTypeName(state)) + ", copy " +
                                 (copy ? std::string(DTypeName(*copy)) : "none");
        std::printf("[ max diff ] %-44s params %.2e  exp_avg %.2e  exp_avg_sq %.2e  copy %.2e\n",
                    what.c_str(), params.relative, exp_avg.relative, exp_avg_sq.relative,
                    param_copy.relative);
        EXPECT_LE(params.relative, kFp32Bound) << what << ": params " << params.ToString();
        EXPECT_LE(exp_avg.relative, BoundFor(state)) << what << ": exp_avg " << exp_avg.ToString();
        EXPECT_LE(exp_avg_sq.relative, BoundFor(state))
            << what << ": exp_avg_sq " << exp_avg_sq.ToString();
        if (copy) {
          EXPECT_LE(param_copy.relative, BoundFor(*copy))
              << what << ": param_copy " << param_copy.ToString();
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllOptimizers, SimdVsReferenceTest,
                         ::testing::Combine(::testing::Values(SimdLevel::kAvx2, SimdLevel::kAvx512),
                                            ::testing::ValuesIn(kOptimizers)),
                         [](const auto& test_info) {
                           return SimdName(std::get<0>(test_info.param)) + "_" +
                                  std::string(OptimizerTypeName(std::get<1>(test_info.param)));
                         });

// Properties that hold exactly, for every build this CPU can run.
class EveryLevelTest : public ::testing::TestWithParam<SimdLevel> {
 protected:
  void SetUp() override {
    if (!SimdLevelSupported(GetParam(), DetectCpuFeatures())) {
      GTEST_SKIP() << "this CPU cannot run " << SimdName(GetParam());
    }
  }
};

TEST_P(EveryLevelTest, ParamCopyIsTheUpdatedParamsRoundedToNearestEven) {
  auto optimizer = CpuOptimizer::Create({.threads = 2, .simd = GetParam()});
  ASSERT_TRUE(optimizer.ok());
  for (DType copy : {DType::kFp16, DType::kBf16}) {
    for (size_t offset : kOffsets) {
      StepArrays arrays(kBlockElements + 77, DType::kBf16, DType::kFp32, copy, offset, 7);
      ASSERT_TRUE(RunStep(*optimizer, OptimizerType::kAdamW, arrays.buffers()).ok());
      for (size_t i = 0; i < arrays.params.numel(); ++i) {
        const float p = arrays.params.Get(i);
        const uint16_t expected = copy == DType::kFp16 ? Fp32ToFp16(p) : Fp32ToBf16(p);
        ASSERT_EQ(arrays.param_copy.Bits(i), expected) << "element " << i;
      }
    }
  }
}

// An update into separate output arrays gives the bits of the update in place, writes nothing
// outside them and leaves its inputs as they were: what lets the engine undo an update by
// keeping the inputs.
TEST_P(EveryLevelTest, AnUpdateOutOfPlaceEqualsOneInPlaceAndKeepsItsInputs) {
  auto optimizer = CpuOptimizer::Create({.threads = 2, .simd = GetParam()});
  ASSERT_TRUE(optimizer.ok());
  for (OptimizerType type : kOptimizers) {
    for (DType state : kStateTypes) {
      for (size_t n : {size_t(1), size_t(17), size_t(1001), kBlockElements + 77}) {
        for (size_t offset : kOffsets) {
          const auto seed = static_cast<uint32_t>(n + offset);
          StepArrays in_place(n, DType::kBf16, state, DType::kBf16, offset, seed);
          StepArrays inputs(n, DType::kBf16, state, DType::kBf16, offset, seed);
          StepArrays untouched(n, DType::kBf16, state, DType::kBf16, offset, seed);
          StepArrays outputs(n, DType::kBf16, state, DType::kBf16, (offset + 3) % 7, seed + 1);
          ASSERT_TRUE(RunStep(*optimizer, type, in_place.buffers()).ok());
          StepBuffers b = inputs.buffers();
          b.params_out = static_cast<float*>(outputs.params.data());
          if (UsesExpAvg(type)) b.exp_avg_out = outputs.exp_avg.data();
          if (UsesExpAvgSq(type)) b.exp_avg_sq_out = outputs.exp_avg_sq.data();
          b.param_copy = outputs.param_copy.data();
          ASSERT_TRUE(RunStep(*optimizer, type, b).ok());
          ASSERT_TRUE(outputs.GuardsIntact() && inputs.GuardsIntact()) << "n=" << n;
          const std::string what = std::string(OptimizerTypeName(type)) + ", states " +
                                   std::string(DTypeName(state)) + ", n=" + std::to_string(n);
          for (size_t i = 0; i < n; ++i) {
            ASSERT_EQ(outputs.params.Bits(i), in_place.params.Bits(i)) << what << ", " << i;
            ASSERT_EQ(outputs.param_copy.Bits(i), in_place.param_copy.Bits(i)) << what;
            ASSERT_EQ(inputs.params.Bits(i), untouched.params.Bits(i)) << what << ", " << i;
            ASSERT_EQ(inputs.exp_avg.Bits(i), untouched.exp_avg.Bits(i)) << what;
            ASSERT_EQ(inputs.exp_avg_sq.Bits(i), untouched.exp_avg_sq.Bits(i)) << what;
            if (UsesExpAvg(type)) {
              ASSERT_EQ(outputs.exp_avg.Bits(i), in_place.exp_avg.Bits(i)) << what << ", " << i;
            }
            if (UsesExpAvgSq(type)) {
              ASSERT_EQ(outputs.exp_avg_sq.Bits(i), in_place.exp_avg_sq.Bits(i)) << what;
            }
          }
        }
      }
    }
  }
}

TEST_P(EveryLevelTest, ResultsDoNotDependOnTheThreadCount) {
  const size_t n = 5 * kBlockElements + 1234;
  for (OptimizerType type : kOptimizers) {
    StepArrays one_thread(n, DType::kFp16, DType::kBf16, DType::kBf16, 1, 3);
    auto single = CpuOptimizer::Create({.threads = 1, .simd = GetParam()});
    ASSERT_TRUE(single.ok());
    ASSERT_TRUE(RunStep(*single, type, one_thread.buffers()).ok());
    for (int threads : {2, 3, 4}) {
      StepArrays many(n, DType::kFp16, DType::kBf16, DType::kBf16, 1, 3);
      auto optimizer = CpuOptimizer::Create({.threads = threads, .simd = GetParam()});
      ASSERT_TRUE(optimizer.ok());
      ASSERT_TRUE(RunStep(*optimizer, type, many.buffers()).ok());
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(many.params.Bits(i), one_thread.params.Bits(i)) << threads << " threads, " << i;
        ASSERT_EQ(many.exp_avg.Bits(i), one_thread.exp_avg.Bits(i)) << i;
        ASSERT_EQ(many.exp_avg_sq.Bits(i), one_thread.exp_avg_sq.Bits(i)) << i;
        ASSERT_EQ(many.param_copy.Bits(i), one_thread.param_copy.Bits(i)) << i;
      }
    }
  }
}

TEST_P(EveryLevelTest, RooflineWritesExactlyTheStepsArrays) {
  auto optimizer = CpuOptimizer::Create({.threads = 2, .simd = GetParam()});
  ASSERT_TRUE(optimizer.ok());
  for (OptimizerType type : kOptimizers) {
    StepArrays arrays(1001, DType::kFp32, DType::kBf16, DType::kBf16, 1, 11);
    StepArrays before(1001, DType::kFp32, DType::kBf16, DType::kBf16, 1, 11);
    ASSERT_TRUE(optimizer->RooflineStep(type, arrays.buffers()).ok());
    EXPECT_TRUE(arrays.GuardsIntact());
    const bool uses_exp_avg = UsesExpAvg(type);
    const bool uses_exp_avg_sq = UsesExpAvgSq(type);
    for (size_t i = 0; i < 1001; ++i) {
      // The roofline adds the gradient to the parameter; skip the exact zeros among them.
      if (arrays.grads.Get(i) != 0) {
        ASSERT_NE(arrays.params.Bits(i), before.params.Bits(i)) << i;
      }
      ASSERT_EQ(arrays.exp_avg.Bits(i) != before.exp_avg.Bits(i), uses_exp_avg) << i;
      ASSERT_EQ(arrays.exp_avg_sq.Bits(i) != before.exp_avg_sq.Bits(i), uses_exp_avg_sq) << i;
      ASSERT_NE(arrays.param_copy.Bits(i), 0u) << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, EveryLevelTest,
                         ::testing::Values(SimdLevel::kScalar, SimdLevel::kAvx2,
                                           SimdLevel::kAvx512),
                         [](const auto& test_info) { return SimdName(test_info.param); });

// Over many steps with fp32 states the builds drift apart only by accumulated rounding.
TEST(SimdDriftTest, FiftyAdamWStepsStayWithinBound) {
  const SimdLevel best = BestSupportedSimdLevel();
  if (best == SimdLevel::kScalar) GTEST_SKIP() << "no SIMD build runs on this CPU";
  auto simd = CpuOptimizer::Create({.threads = 2, .simd = best});
  auto reference = CpuOptimizer::Create({.threads = 2, .simd = SimdLevel::kScalar});
  ASSERT_TRUE(simd.ok() && reference.ok());
  StepArrays actual(4099, DType::kFp32, DType::kFp32, std::nullopt, 1, 5);
  StepArrays expected(4099, DType::kFp32, DType::kFp32, std::nullopt, 1, 5);
  for (int64_t step = 1; step <= 50; ++step) {
    const AdamWHyperParams h{.lr = 1e-3 / static_cast<double>(step), .step = step};
    ASSERT_TRUE(simd->Step(h, actual.buffers()).ok());
    ASSERT_TRUE(reference->Step(h, expected.buffers()).ok());
  }
  const Difference params = MaxRelativeDifference(actual.params, expected.params);
  const Difference exp_avg_sq = MaxRelativeDifference(actual.exp_avg_sq, expected.exp_avg_sq);
  std::printf("[ max diff ] 50 AdamW steps: params %.2e  exp_avg_sq %.2e\n", params.relative,
              exp_avg_sq.relative);
  // The same gradients every step: each step's rounding differences add up, about 50 x one step.
  EXPECT_LE(params.relative, 50 * kFp32Bound) << params.ToString();
  EXPECT_LE(exp_avg_sq.relative, 50 * kFp32Bound) << exp_avg_sq.ToString();
}

}  // namespace
}  // namespace strata::cpu_adam
