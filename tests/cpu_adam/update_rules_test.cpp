// The update rules against their formulas, evaluated in double precision here, for every build
// this CPU can run: AdamW, Adam, Adagrad and Lion as torch.optim (and the Lion paper) define them.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "strata/cpu_adam/cpu_optimizer.h"
#include "test_arrays.h"

namespace strata::cpu_adam {
namespace {

using testing::SupportedLevels;

// fp32 arithmetic against double formulas: a few units in the last place of fp32.
constexpr double kTolerance = 1e-6;

/// A few parameters with their states, all fp32, stepped by every supported build.
struct Case {
  std::vector<float> params{0.5f, -1.25f, 2.0f, 0.0f, -0.75f, 1e-3f, 3.0f, -2.5f, 0.1f};
  std::vector<float> grads{0.1f, -0.2f, 0.0f, 0.3f, -1e-3f, 0.05f, -0.4f, 0.25f, 1e-5f};
  std::vector<float> exp_avg{0.01f, 0.02f, -0.03f, 0.0f, 0.05f, -0.01f, 0.0f, 0.02f, 0.0f};
  std::vector<float> exp_avg_sq{1e-3f, 2e-3f, 5e-4f, 0.0f, 1e-4f, 1e-3f, 0.0f, 2e-2f, 1e-6f};

  StepBuffers buffers() {
    return {.numel = params.size(),
            .params = params.data(),
            .grads = grads.data(),
            .exp_avg = exp_avg.data(),
            .exp_avg_sq = exp_avg_sq.data()};
  }
};

void ExpectNear(double actual, double expected, const char* what, size_t i, SimdLevel level) {
  EXPECT_NEAR(actual, expected, kTolerance * std::max(1.0, std::abs(expected)))
      << what << "[" << i << "] with " << SimdLevelName(level);
}

template <typename HyperParams, typename Formula>
void CheckAgainstFormula(const HyperParams& h, Formula formula) {
  for (SimdLevel level : SupportedLevels()) {
    auto optimizer = CpuOptimizer::Create({.threads = 1, .simd = level});
    ASSERT_TRUE(optimizer.ok());
    Case before, after;
    ASSERT_TRUE(optimizer->Step(h, after.buffers()).ok());
    for (size_t i = 0; i < before.params.size(); ++i) {
      double p = before.params[i], m = before.exp_avg[i], v = before.exp_avg_sq[i];
      formula(p, double{before.grads[i]}, m, v);
      ExpectNear(after.params[i], p, "params", i, level);
      ExpectNear(after.exp_avg[i], m, "exp_avg", i, level);
      ExpectNear(after.exp_avg_sq[i], v, "exp_avg_sq", i, level);
    }
  }
}

TEST(UpdateRulesTest, AdamWDecaysTheParameterThenAppliesAdam) {
  const AdamWHyperParams h{.lr = 1e-2,
                           .beta1 = 0.8,
                           .beta2 = 0.99,
                           .eps = 1e-6,
                           .weight_decay = 0.1,
                           .step = 3,
                           .grad_scale = 0.5};
  CheckAgainstFormula(h, [&](double& p, double g, double& m, double& v) {
    g *= h.grad_scale;
    p *= 1 - h.lr * h.weight_decay;
    m = h.beta1 * m + (1 - h.beta1) * g;
    v = h.beta2 * v + (1 - h.beta2) * g * g;
    const double m_hat = m / (1 - std::pow(h.beta1, 3));
    const double v_hat = v / (1 - std::pow(h.beta2, 3));
    p -= h.lr * m_hat / (std::sqrt(v_hat) + h.eps);  // Kingma & Ba's m_hat, v_hat.
  });
}

TEST(UpdateRulesTest, AdamAddsTheWeightDecayToTheGradient) {
  const AdamHyperParams h{
      .lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.05, .step = 1};
  CheckAgainstFormula(h, [&](double& p, double g, double& m, double& v) {
    g += h.weight_decay * p;
    m = h.beta1 * m + (1 - h.beta1) * g;
    v = h.beta2 * v + (1 - h.beta2) * g * g;
    // torch: p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    p -= h.lr / (1 - h.beta1) * m / (std::sqrt(v) / std::sqrt(1 - h.beta2) + h.eps);
  });
}

TEST(UpdateRulesTest, AdamWithoutBiasCorrection) {
  const AdamHyperParams h{.lr = 1e-3, .eps = 1e-8, .bias_correction = false, .step = 0};
  CheckAgainstFormula(h, [&](double& p, double g, double& m, double& v) {
    m = h.beta1 * m + (1 - h.beta1) * g;
    v = h.beta2 * v + (1 - h.beta2) * g * g;
    p -= h.lr * m / (std::sqrt(v) + h.eps);
  });
}

TEST(UpdateRulesTest, AdagradWithLearningRateDecay) {
  const AdagradHyperParams h{
      .lr = 0.1, .lr_decay = 0.5, .weight_decay = 0.01, .eps = 1e-10, .step = 4, .grad_scale = 2.0};
  CheckAgainstFormula(h, [&](double& p, double g, double& /*m*/, double& sum) {
    g = g * h.grad_scale + h.weight_decay * p;
    sum += g * g;
    const double clr = h.lr / (1 + (4 - 1) * h.lr_decay);
    p -= clr * g / (std::sqrt(sum) + h.eps);
  });
}

TEST(UpdateRulesTest, LionMovesBySignAndDecouplesWeightDecay) {
  const LionHyperParams h{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.5};
  CheckAgainstFormula(h, [&](double& p, double g, double& m, double& /*v*/) {
    const double c = h.beta1 * m + (1 - h.beta1) * g;
    const double sign = c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0);
    p = p * (1 - h.lr * h.weight_decay) - h.lr * sign;
    m = h.beta2 * m + (1 - h.beta2) * g;
  });
}

TEST(UpdateRulesTest, FirstAdamStepMovesEachParameterByAboutLr) {
  // With zero states and bias correction, the first step is lr * g / (|g| + eps).
  for (SimdLevel level : SupportedLevels()) {
    auto optimizer = CpuOptimizer::Create({.threads = 1, .simd = level});
    ASSERT_TRUE(optimizer.ok());
    std::vector<float> params(37, 1.0f), grads(37), exp_avg(37, 0.0f), exp_avg_sq(37, 0.0f);
    for (size_t i = 0; i < grads.size(); ++i) grads[i] = (i % 2 ? 1.0f : -1.0f) * (1 + i);
    ASSERT_TRUE(optimizer
                    ->Step(AdamHyperParams{.lr = 0.01, .eps = 0}, {.numel = 37,
                                                                   .params = params.data(),
                                                                   .grads = grads.data(),
                                                                   .exp_avg = exp_avg.data(),
                                                                   .exp_avg_sq = exp_avg_sq.data()})
                    .ok());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_NEAR(params[i], 1.0f - 0.01f * (i % 2 ? 1.0f : -1.0f), 1e-6) << i;
    }
  }
}

TEST(UpdateRulesTest, GradScaleIsExactlyAPreMultiplication) {
  // Scaling by a power of two is exact, so grads * 4 with grad_scale 1/4 must equal the
  // unscaled step bit for bit.
  for (SimdLevel level : SupportedLevels()) {
    auto optimizer = CpuOptimizer::Create({.threads = 1, .simd = level});
    ASSERT_TRUE(optimizer.ok());
    Case plain, scaled;
    for (float& g : scaled.grads) g *= 4;
    ASSERT_TRUE(optimizer->Step(AdamWHyperParams{.step = 2}, plain.buffers()).ok());
    ASSERT_TRUE(
        optimizer->Step(AdamWHyperParams{.step = 2, .grad_scale = 0.25}, scaled.buffers()).ok());
    EXPECT_EQ(plain.params, scaled.params) << SimdLevelName(level);
    EXPECT_EQ(plain.exp_avg, scaled.exp_avg) << SimdLevelName(level);
    EXPECT_EQ(plain.exp_avg_sq, scaled.exp_avg_sq) << SimdLevelName(level);
  }
}

TEST(UpdateRulesTest, DefaultsAreTorchs) {
  EXPECT_EQ(AdamWHyperParams{}.lr, 1e-3);
  EXPECT_EQ(AdamWHyperParams{}.weight_decay, 1e-2);
  EXPECT_EQ(AdamWHyperParams{}.eps, 1e-8);
  EXPECT_EQ(AdamHyperParams{}.weight_decay, 0.0);
  EXPECT_EQ(AdamHyperParams{}.beta2, 0.999);
  EXPECT_EQ(AdagradHyperParams{}.lr, 1e-2);
  EXPECT_EQ(AdagradHyperParams{}.eps, 1e-10);
  EXPECT_EQ(AdagradHyperParams{}.lr_decay, 0.0);
  EXPECT_EQ(LionHyperParams{}.lr, 1e-4);
  EXPECT_EQ(LionHyperParams{}.beta2, 0.99);
}

}  // namespace
}  // namespace strata::cpu_adam
