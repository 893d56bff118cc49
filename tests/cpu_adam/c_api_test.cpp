// The C interface, as another language would use it.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "strata/cpu_adam/strata_c.h"

namespace {

class CApiTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(strata_cpu_optimizer_create(2, nullptr, &optimizer_), 0); }
  void TearDown() override { strata_cpu_optimizer_destroy(optimizer_); }

  strata_step_buffers Buffers() {
    strata_step_buffers b{};
    b.numel = params_.size();
    b.params = params_.data();
    b.grads = grads_.data();
    b.grad_dtype = STRATA_C_FP32;
    b.exp_avg = exp_avg_.data();
    b.exp_avg_sq = exp_avg_sq_.data();
    b.state_dtype = STRATA_C_FP32;
    return b;
  }

  strata_cpu_optimizer* optimizer_ = nullptr;
  std::vector<float> params_ = std::vector<float>(100, 1.0f);
  std::vector<float> grads_ = std::vector<float>(100, 0.5f);
  std::vector<float> exp_avg_ = std::vector<float>(100, 0.0f);
  std::vector<float> exp_avg_sq_ = std::vector<float>(100, 0.0f);
};

TEST_F(CApiTest, CreateReportsItsSettings) {
  EXPECT_EQ(strata_cpu_optimizer_threads(optimizer_), 2);
  const std::string level = strata_cpu_optimizer_simd_level(optimizer_);
  EXPECT_TRUE(level == "scalar" || level == "avx2" || level == "avx512") << level;

  strata_cpu_optimizer* scalar = nullptr;
  ASSERT_EQ(strata_cpu_optimizer_create(1, "scalar", &scalar), 0);
  EXPECT_STREQ(strata_cpu_optimizer_simd_level(scalar), "scalar");
  strata_cpu_optimizer_destroy(scalar);
}

TEST_F(CApiTest, CreateFailsWithAMessage) {
  strata_cpu_optimizer* bad = nullptr;
  EXPECT_EQ(strata_cpu_optimizer_create(1, "sse9", &bad), STRATA_C_INVALID_ARGUMENT);
  EXPECT_EQ(bad, nullptr);
  EXPECT_NE(std::string(strata_last_error()).find("sse9"), std::string::npos);
  EXPECT_EQ(strata_cpu_optimizer_create(-2, nullptr, &bad), STRATA_C_INVALID_ARGUMENT);
  strata_cpu_optimizer_destroy(nullptr);  // Allowed.
}

TEST_F(CApiTest, DefaultsAreTorchs) {
  strata_adam_hyper_params adamw, adam;
  strata_adamw_defaults(&adamw);
  strata_adam_defaults(&adam);
  EXPECT_EQ(adamw.lr, 1e-3);
  EXPECT_EQ(adamw.weight_decay, 1e-2);
  EXPECT_EQ(adam.weight_decay, 0.0);
  EXPECT_EQ(adamw.bias_correction, 1);
  EXPECT_EQ(adamw.step, 1);
  strata_adagrad_hyper_params adagrad;
  strata_adagrad_defaults(&adagrad);
  EXPECT_EQ(adagrad.eps, 1e-10);
  strata_lion_hyper_params lion;
  strata_lion_defaults(&lion);
  EXPECT_EQ(lion.lr, 1e-4);
}

TEST_F(CApiTest, StepsMatchTheCppInterface) {
  strata_adam_hyper_params h;
  strata_adamw_defaults(&h);
  h.step = 3;
  const strata_step_buffers b = Buffers();
  ASSERT_EQ(strata_adamw_step(optimizer_, &h, &b), 0) << strata_last_error();

  auto cpp = strata::cpu_adam::CpuOptimizer::Create(
      {.threads = 2, .simd = strata::cpu_adam::BestSupportedSimdLevel()});
  ASSERT_TRUE(cpp.ok());
  std::vector<float> p(100, 1.0f), g(100, 0.5f), m(100, 0.0f), v(100, 0.0f);
  ASSERT_TRUE(cpp->Step(strata::cpu_adam::AdamWHyperParams{.step = 3}, {.numel = 100,
                                                                        .params = p.data(),
                                                                        .grads = g.data(),
                                                                        .exp_avg = m.data(),
                                                                        .exp_avg_sq = v.data()})
                  .ok());
  if (std::string(strata_cpu_optimizer_simd_level(optimizer_)) ==
      strata::cpu_adam::SimdLevelName(strata::cpu_adam::BestSupportedSimdLevel())) {
    EXPECT_EQ(params_, p);
    EXPECT_EQ(exp_avg_, m);
    EXPECT_EQ(exp_avg_sq_, v);
  }

  strata_adam_defaults(&h);
  EXPECT_EQ(strata_adam_step(optimizer_, &h, &b), 0);
  strata_adagrad_hyper_params adagrad;
  strata_adagrad_defaults(&adagrad);
  EXPECT_EQ(strata_adagrad_step(optimizer_, &adagrad, &b), 0);
  strata_lion_hyper_params lion;
  strata_lion_defaults(&lion);
  EXPECT_EQ(strata_lion_step(optimizer_, &lion, &b), 0);
}

TEST_F(CApiTest, ParamCopyAndBf16Gradients) {
  std::vector<uint16_t> grads(100, strata::Fp32ToBf16(0.25f));
  std::vector<uint16_t> copy(100, 0);
  strata_step_buffers b = Buffers();
  b.grads = grads.data();
  b.grad_dtype = STRATA_C_BF16;
  b.param_copy = copy.data();
  b.param_copy_dtype = STRATA_C_FP16;
  strata_adam_hyper_params h;
  strata_adamw_defaults(&h);
  ASSERT_EQ(strata_adamw_step(optimizer_, &h, &b), 0) << strata_last_error();
  for (size_t i = 0; i < copy.size(); ++i) EXPECT_EQ(copy[i], strata::Fp32ToFp16(params_[i]));
}

TEST_F(CApiTest, ErrorsReturnTheirCodeAndMessage) {
  strata_adam_hyper_params h;
  strata_adamw_defaults(&h);
  h.lr = -1;
  const strata_step_buffers b = Buffers();
  EXPECT_EQ(strata_adamw_step(optimizer_, &h, &b), STRATA_C_INVALID_ARGUMENT);
  EXPECT_NE(std::string(strata_last_error()).find("lr"), std::string::npos);
  strata_adamw_defaults(&h);
  EXPECT_EQ(strata_adamw_step(optimizer_, &h, &b), 0);
  EXPECT_STREQ(strata_last_error(), "");
  strata_step_buffers bad_dtype = Buffers();
  bad_dtype.grad_dtype = 7;
  EXPECT_EQ(strata_adamw_step(optimizer_, &h, &bad_dtype), STRATA_C_INVALID_ARGUMENT);
  EXPECT_EQ(strata_adamw_step(optimizer_, nullptr, &b), STRATA_C_INVALID_ARGUMENT);
  EXPECT_EQ(strata_adamw_step(nullptr, &h, &b), STRATA_C_INVALID_ARGUMENT);
}

TEST_F(CApiTest, GradientStatsAndFill) {
  double sum = 0;
  int32_t finite = 0;
  ASSERT_EQ(
      strata_gradient_stats(optimizer_, grads_.data(), STRATA_C_FP32, grads_.size(), &sum, &finite),
      0);
  EXPECT_EQ(sum, 25.0);
  EXPECT_EQ(finite, 1);
  ASSERT_EQ(strata_fill(optimizer_, exp_avg_sq_.data(), STRATA_C_FP32, exp_avg_sq_.size(), 0.1f),
            0);
  EXPECT_EQ(exp_avg_sq_[99], 0.1f);
}

}  // namespace
