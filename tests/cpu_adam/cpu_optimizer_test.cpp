// The driver: options, SIMD selection, validation with actionable messages, Fill, ParallelFor.
#include "strata/cpu_adam/cpu_optimizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "test_arrays.h"

namespace strata::cpu_adam {
namespace {

TEST(SimdLevelTest, NamesRoundTrip) {
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    auto parsed = ParseSimdLevel(SimdLevelName(level));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, level);
  }
  EXPECT_EQ(*ParseSimdLevel("AVX2"), SimdLevel::kAvx2);
  auto bad = ParseSimdLevel("sse9");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("expected scalar, avx2 or avx512"), std::string::npos);
}

TEST(SimdLevelTest, SupportFollowsCpuFeatures) {
  CpuFeatures none;
  EXPECT_TRUE(SimdLevelSupported(SimdLevel::kScalar, none));
  EXPECT_FALSE(SimdLevelSupported(SimdLevel::kAvx2, none));
  CpuFeatures avx2{.avx2 = true, .fma = true, .f16c = true};
  EXPECT_TRUE(SimdLevelSupported(SimdLevel::kAvx2, avx2));
  EXPECT_FALSE(SimdLevelSupported(SimdLevel::kAvx512, avx2));
  CpuFeatures avx2_no_fma{.avx2 = true, .f16c = true};
  EXPECT_FALSE(SimdLevelSupported(SimdLevel::kAvx2, avx2_no_fma));
  CpuFeatures avx512 = avx2;
  avx512.avx512f = true;
  EXPECT_TRUE(SimdLevelSupported(SimdLevel::kAvx512, avx512));
  EXPECT_TRUE(SimdLevelSupported(BestSupportedSimdLevel(), DetectCpuFeatures()));
}

/// Sets STRATA_SIMD for one test and restores it afterwards.
class ScopedSimdEnvironment {
 public:
  explicit ScopedSimdEnvironment(const char* value) {
    if (const char* old = std::getenv("STRATA_SIMD")) saved_ = old;
    setenv("STRATA_SIMD", value, 1);
  }
  ~ScopedSimdEnvironment() {
    if (saved_.has_value()) {
      setenv("STRATA_SIMD", saved_->c_str(), 1);
    } else {
      unsetenv("STRATA_SIMD");
    }
  }

 private:
  std::optional<std::string> saved_;
};

TEST(SimdLevelTest, EnvironmentForcesALevelUnlessCodeRequestsOne) {
  {
    ScopedSimdEnvironment env("scalar");
    EXPECT_EQ(*ResolveSimdLevel(std::nullopt), SimdLevel::kScalar);
    auto optimizer = CpuOptimizer::Create();
    ASSERT_TRUE(optimizer.ok());
    EXPECT_EQ(optimizer->simd_level(), SimdLevel::kScalar);
    // An explicit request wins over the environment.
    EXPECT_EQ(*ResolveSimdLevel(BestSupportedSimdLevel()), BestSupportedSimdLevel());
  }
  {
    ScopedSimdEnvironment env("auto");
    EXPECT_EQ(*ResolveSimdLevel(std::nullopt), BestSupportedSimdLevel());
  }
  {
    ScopedSimdEnvironment env("avx1024");
    auto level = ResolveSimdLevel(std::nullopt);
    EXPECT_EQ(level.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(level.status().message().find("STRATA_SIMD=avx1024"), std::string::npos);
  }
}

TEST(SimdLevelTest, UnsupportedLevelIsUnavailableAndSaysWhatIsMissing) {
  if (SimdLevelSupported(SimdLevel::kAvx512, DetectCpuFeatures())) {
    GTEST_SKIP() << "this CPU runs every level";
  }
  auto optimizer = CpuOptimizer::Create({.simd = SimdLevel::kAvx512});
  EXPECT_EQ(optimizer.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(optimizer.status().message().find("AVX-512F"), std::string::npos)
      << optimizer.status().message();
}

TEST(CpuOptimizerTest, ThreadsDefaultToAllAndRejectNegative) {
  auto optimizer = CpuOptimizer::Create();
  ASSERT_TRUE(optimizer.ok());
  EXPECT_GE(optimizer->threads(), 1);
  auto three = CpuOptimizer::Create({.threads = 3});
  ASSERT_TRUE(three.ok());
  EXPECT_EQ(three->threads(), 3);
  EXPECT_EQ(CpuOptimizer::Create({.threads = -1}).status().code(), StatusCode::kInvalidArgument);
}

TEST(CpuOptimizerTest, MovedOptimizerKeepsWorking) {
  auto created = CpuOptimizer::Create({.threads = 2});
  ASSERT_TRUE(created.ok());
  CpuOptimizer optimizer = std::move(*created);
  std::vector<float> p(10, 1.0f), g(10, 0.5f), m(10, 0.0f), v(10, 0.0f);
  EXPECT_TRUE(optimizer
                  .Step(AdamWHyperParams{}, {.numel = 10,
                                             .params = p.data(),
                                             .grads = g.data(),
                                             .exp_avg = m.data(),
                                             .exp_avg_sq = v.data()})
                  .ok());
  EXPECT_LT(p[0], 1.0f);
}

class ValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto created = CpuOptimizer::Create({.threads = 1});
    ASSERT_TRUE(created.ok());
    optimizer_.emplace(std::move(*created));
  }

  StepBuffers Buffers() {
    return {.numel = 8,
            .params = p_.data(),
            .grads = g_.data(),
            .exp_avg = m_.data(),
            .exp_avg_sq = v_.data()};
  }

  /// Expects InvalidArgument whose message contains `text`, and no change to the params.
  void ExpectRejected(const Status& status, const std::string& text) {
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find(text), std::string::npos) << status.message();
    EXPECT_EQ(p_, std::vector<float>(8, 1.0f));
  }

  std::optional<CpuOptimizer> optimizer_;
  std::vector<float> p_ = std::vector<float>(8, 1.0f);
  std::vector<float> g_ = std::vector<float>(8, 0.5f);
  std::vector<float> m_ = std::vector<float>(8, 0.0f);
  std::vector<float> v_ = std::vector<float>(8, 0.0f);
};

TEST_F(ValidationTest, BadHyperParametersNameTheField) {
  ExpectRejected(optimizer_->Step(AdamWHyperParams{.lr = -1}, Buffers()), "AdamW step: lr");
  ExpectRejected(optimizer_->Step(AdamWHyperParams{.beta1 = 1.0}, Buffers()),
                 "beta1 must be in [0, 1)");
  ExpectRejected(optimizer_->Step(AdamHyperParams{.beta2 = -0.1}, Buffers()), "Adam step: beta2");
  ExpectRejected(optimizer_->Step(AdamHyperParams{.eps = NAN}, Buffers()), "eps");
  ExpectRejected(optimizer_->Step(AdamWHyperParams{.weight_decay = -0.1}, Buffers()),
                 "weight_decay");
  ExpectRejected(optimizer_->Step(AdamWHyperParams{.step = 0}, Buffers()), "step must be >= 1");
  ExpectRejected(optimizer_->Step(AdamWHyperParams{.grad_scale = INFINITY}, Buffers()),
                 "grad_scale");
  ExpectRejected(optimizer_->Step(AdagradHyperParams{.lr_decay = -1}, Buffers()),
                 "Adagrad step: lr_decay");
  ExpectRejected(optimizer_->Step(AdagradHyperParams{.step = 0}, Buffers()), "step");
  ExpectRejected(optimizer_->Step(LionHyperParams{.beta1 = 1.5}, Buffers()),
                 "Lion step: beta1 must be in [0, 1]");
  // Without bias correction the step number is not used, so 0 is fine.
  EXPECT_TRUE(
      optimizer_->Step(AdamWHyperParams{.bias_correction = false, .step = 0}, Buffers()).ok());
}

TEST_F(ValidationTest, BadBuffersNameTheArray) {
  StepBuffers b = Buffers();
  b.params = nullptr;
  ExpectRejected(optimizer_->Step(AdamWHyperParams{}, b), "params is null but numel is 8");
  b = Buffers();
  b.exp_avg_sq = nullptr;
  ExpectRejected(optimizer_->Step(AdamWHyperParams{}, b), "exp_avg_sq is null");
  b = Buffers();
  b.grads = reinterpret_cast<const uint8_t*>(g_.data()) + 2;
  ExpectRejected(optimizer_->Step(AdamWHyperParams{}, b), "grads is not aligned");
  b = Buffers();
  b.state_dtype = DType::kFp16;
  ExpectRejected(optimizer_->Step(AdamWHyperParams{}, b), "use fp32 or bf16");
  b = Buffers();
  b.param_copy = m_.data();
  b.param_copy_dtype = DType::kFp32;
  ExpectRejected(optimizer_->Step(AdamWHyperParams{}, b), "param_copy_dtype must be fp16 or bf16");
  // Outputs apart from the inputs: one shifted onto an input, or one the optimizer lacks.
  b = Buffers();
  b.exp_avg_out = m_.data() + 1;
  ExpectRejected(optimizer_->Step(AdamWHyperParams{}, b), "exp_avg_out overlaps an input array");
  b = Buffers();
  std::vector<float> out(8);
  b.exp_avg_out = out.data();
  ExpectRejected(optimizer_->Step(AdagradHyperParams{}, b),
                 "exp_avg_out is given but this optimizer has no such state");
}

TEST_F(ValidationTest, UnusedStatesMayBeNullAndEmptyStepsDoNothing) {
  StepBuffers adagrad = Buffers();
  adagrad.exp_avg = nullptr;
  EXPECT_TRUE(optimizer_->Step(AdagradHyperParams{}, adagrad).ok());
  StepBuffers lion = Buffers();
  lion.exp_avg_sq = nullptr;
  EXPECT_TRUE(optimizer_->Step(LionHyperParams{}, lion).ok());
  EXPECT_TRUE(optimizer_->Step(AdamWHyperParams{}, StepBuffers{}).ok());
}

TEST(CpuOptimizerTest, FillSetsEveryElementInEachDtype) {
  auto optimizer = CpuOptimizer::Create({.threads = 2});
  ASSERT_TRUE(optimizer.ok());
  const size_t n = 3 * kBlockElements + 11;
  for (DType dtype : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    testing::GuardedArray array(dtype, n, 1);
    ASSERT_TRUE(optimizer->Fill(array.data(), dtype, n, 0.1f).ok());
    const float expected = testing::ToFloat(dtype, array.data(), 0);
    EXPECT_NEAR(expected, 0.1f, 1e-3);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(array.Get(i), expected) << DTypeName(dtype) << i;
    EXPECT_TRUE(array.GuardsIntact());
  }
  EXPECT_EQ(optimizer->Fill(nullptr, DType::kFp32, 1, 0).code(), StatusCode::kInvalidArgument);
}

TEST(CpuOptimizerTest, ParallelForCoversEachElementOnceInBlockAlignedRanges) {
  for (int threads : {1, 2, 3}) {
    auto optimizer = CpuOptimizer::Create({.threads = threads});
    ASSERT_TRUE(optimizer.ok());
    for (size_t n : {size_t{0}, size_t{5}, kBlockElements, 10 * kBlockElements + 3}) {
      std::mutex mutex;
      std::vector<std::pair<size_t, size_t>> ranges;
      optimizer->ParallelFor(n, [&](size_t begin, size_t end) {
        std::lock_guard<std::mutex> lock(mutex);
        ranges.emplace_back(begin, end);
      });
      std::sort(ranges.begin(), ranges.end());
      size_t next = 0;
      for (const auto& [begin, end] : ranges) {
        EXPECT_EQ(begin, next);
        EXPECT_EQ(begin % kBlockElements, 0u);
        EXPECT_LT(begin, end);
        next = end;
      }
      EXPECT_EQ(next, n);
      EXPECT_LE(ranges.size(), static_cast<size_t>(threads));
    }
  }
}

}  // namespace
}  // namespace strata::cpu_adam
