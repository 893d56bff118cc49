// Tests for strata/offload/loss_scaler.h.
//
// The expected values are DeepSpeed's DynamicLossScaler.update_scale with
// consecutive_hysteresis=False (deepspeed/runtime/fp16/loss_scaler.py), worked out by hand:
//
//   init: cur_scale = 2**initial_scale_power; cur_iter = 0; last_overflow_iter = -1
//         cur_hysteresis = delayed_shift = hysteresis
//   update_scale(overflow):
//     if overflow:
//       if delayed_shift == 1 or cur_hysteresis == 1: cur_scale = max(cur_scale / 2, min_scale)
//       else: cur_hysteresis -= 1
//       last_overflow_iter = cur_iter
//     else:
//       if (cur_iter - last_overflow_iter) % scale_window == 0:
//         cur_hysteresis = delayed_shift; cur_scale *= 2
//     cur_iter += 1

#include "strata/offload/loss_scaler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/options.h"

namespace strata::offload {
namespace {

PrecisionOptions Fp16(int initial_scale_power = 16, int window = 1000, int hysteresis = 2,
                      double min_loss_scale = 1.0) {
  PrecisionOptions options;
  options.working_dtype = DType::kFp16;
  options.initial_scale_power = initial_scale_power;
  options.loss_scale_window = window;
  options.hysteresis = hysteresis;
  options.min_loss_scale = min_loss_scale;
  return options;
}

/// Feeds `overflows` to `scaler` and returns the scale after each Update.
std::vector<double> ScalesAfter(LossScaler& scaler, const std::vector<bool>& overflows) {
  std::vector<double> scales;
  for (bool overflow : overflows) {
    scaler.Update(overflow);
    scales.push_back(scaler.scale());
  }
  return scales;
}

TEST(LossScalerTest, Bf16AndFp32NeedNoScaling) {
  for (DType dtype : {DType::kBf16, DType::kFp32}) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    PrecisionOptions options = Fp16(/*initial_scale_power=*/10, /*window=*/1, /*hysteresis=*/1);
    options.working_dtype = dtype;
    LossScaler scaler(options);
    EXPECT_EQ(scaler.scale(), 1.0);
    EXPECT_FALSE(scaler.checks_overflow());
    for (int i = 0; i < 10; ++i) {
      scaler.Update(i % 3 == 0);
      EXPECT_EQ(scaler.scale(), 1.0) << "after step " << i;
    }
    EXPECT_EQ(scaler.state().iteration, 10);
  }
}

TEST(LossScalerTest, DefaultOptionsAreBf16WithoutScaling) {
  LossScaler scaler(PrecisionOptions{});
  EXPECT_EQ(scaler.scale(), 1.0);
  EXPECT_FALSE(scaler.checks_overflow());
}

TEST(LossScalerTest, StaticScaleIsIgnoredOutsideFp16) {
  PrecisionOptions options;
  options.working_dtype = DType::kFp32;
  options.loss_scale = 128.0;
  LossScaler scaler(options);
  EXPECT_EQ(scaler.scale(), 1.0);
  EXPECT_FALSE(scaler.checks_overflow());
}

TEST(LossScalerTest, Fp16DynamicStartsAtTwoToTheInitialPower) {
  LossScaler scaler(Fp16());
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_TRUE(scaler.checks_overflow());
  const LossScalerState want{
      .scale = 65536.0, .iteration = 0, .last_overflow_iteration = -1, .hysteresis_left = 2};
  EXPECT_EQ(scaler.state(), want);

  EXPECT_EQ(LossScaler(Fp16(/*initial_scale_power=*/0)).scale(), 1.0);
  EXPECT_EQ(LossScaler(Fp16(/*initial_scale_power=*/5)).scale(), 32.0);
  EXPECT_EQ(LossScaler(Fp16(/*initial_scale_power=*/32)).scale(), 4294967296.0);
}

TEST(LossScalerTest, FirstOverflowIsToleratedSecondHalves) {
  // Default PrecisionOptions values: 2^16, window 1000, hysteresis 2, min 1.
  PrecisionOptions options;
  options.working_dtype = DType::kFp16;
  LossScaler scaler(options);

  scaler.Update(true);
  EXPECT_EQ(
      scaler.state(),
      (LossScalerState{
          .scale = 65536.0, .iteration = 1, .last_overflow_iteration = 0, .hysteresis_left = 1}));
  scaler.Update(true);
  EXPECT_EQ(
      scaler.state(),
      (LossScalerState{
          .scale = 32768.0, .iteration = 2, .last_overflow_iteration = 1, .hysteresis_left = 1}));
  // Hysteresis stays spent: every further overflow halves.
  scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 16384.0);
  scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 8192.0);
  EXPECT_EQ(scaler.state().last_overflow_iteration, 3);
  EXPECT_EQ(scaler.state().iteration, 4);
  EXPECT_EQ(scaler.state().hysteresis_left, 1);
}

TEST(LossScalerTest, CleanStepsDoNotRefillHysteresis) {
  // consecutive_hysteresis=False: only growth refills it.
  LossScaler scaler(Fp16());
  scaler.Update(true);  // Tolerated.
  for (int i = 0; i < 10; ++i) scaler.Update(false);
  EXPECT_EQ(scaler.state().hysteresis_left, 1);
  EXPECT_EQ(scaler.scale(), 65536.0);
  scaler.Update(true);  // Halves.
  EXPECT_EQ(scaler.scale(), 32768.0);
  EXPECT_EQ(scaler.state().iteration, 12);
  EXPECT_EQ(scaler.state().last_overflow_iteration, 11);
}

TEST(LossScalerTest, HysteresisOfOneHalvesOnEveryOverflow) {
  LossScaler scaler(Fp16(/*initial_scale_power=*/8, /*window=*/1000, /*hysteresis=*/1));
  EXPECT_EQ(ScalesAfter(scaler, {true, true, false, true}),
            (std::vector<double>{128.0, 64.0, 64.0, 32.0}));
}

TEST(LossScalerTest, HysteresisOfThreeToleratesTwoOverflows) {
  LossScaler scaler(Fp16(/*initial_scale_power=*/8, /*window=*/1000, /*hysteresis=*/3));
  EXPECT_EQ(ScalesAfter(scaler, {true, true, true, true}),
            (std::vector<double>{256.0, 256.0, 128.0, 64.0}));
}

TEST(LossScalerTest, GrowsAfterExactlyWindowCleanSteps) {
  LossScaler scaler(Fp16(/*initial_scale_power=*/4, /*window=*/3));
  // Growth at iterations 2, 5, 8: (iteration + 1) % 3 == 0.
  EXPECT_EQ(ScalesAfter(scaler, std::vector<bool>(9, false)),
            (std::vector<double>{16, 16, 32, 32, 32, 64, 64, 64, 128}));
  EXPECT_EQ(scaler.state().iteration, 9);
  EXPECT_EQ(scaler.state().last_overflow_iteration, -1);
}

TEST(LossScalerTest, WindowOfOneGrowsEveryCleanStep) {
  LossScaler scaler(Fp16(/*initial_scale_power=*/0, /*window=*/1, /*hysteresis=*/1));
  EXPECT_EQ(ScalesAfter(scaler, {false, false, false, true, false}),
            (std::vector<double>{2, 4, 8, 4, 8}));
}

TEST(LossScalerTest, WindowCountsFromTheLastOverflow) {
  LossScaler scaler(Fp16(/*initial_scale_power=*/4, /*window=*/3, /*hysteresis=*/1));
  // Iteration 0 overflows: 16 -> 8. Clean iterations 1, 2 do not grow; 3 - 0 = 3 does, and then
  // 6 - 0 = 6. An overflow at 7 halves and restarts the count: growth again at 10.
  const std::vector<bool> overflows = {true,  false, false, false, false, false,
                                       false, true,  false, false, false};
  EXPECT_EQ(ScalesAfter(scaler, overflows),
            (std::vector<double>{8, 8, 8, 16, 16, 16, 32, 16, 16, 16, 32}));
  EXPECT_EQ(scaler.state().last_overflow_iteration, 7);
  EXPECT_EQ(scaler.state().iteration, 11);
}

TEST(LossScalerTest, OverflowJustBeforeGrowthPostponesIt) {
  LossScaler scaler(Fp16(/*initial_scale_power=*/4, /*window=*/3, /*hysteresis=*/2));
  // Clean, clean, then an overflow where growth would have come (tolerated: no halving). The next
  // growth is three clean steps later, at iteration 5.
  EXPECT_EQ(ScalesAfter(scaler, {false, false, true, false, false, false}),
            (std::vector<double>{16, 16, 16, 16, 16, 32}));
  EXPECT_EQ(scaler.state().hysteresis_left, 2);
}

TEST(LossScalerTest, GrowthRefillsHysteresis) {
  LossScaler scaler(Fp16(/*initial_scale_power=*/4, /*window=*/3, /*hysteresis=*/2));
  scaler.Update(true);  // Tolerated: 16, one overflow left.
  EXPECT_EQ(scaler.state().hysteresis_left, 1);
  EXPECT_EQ(ScalesAfter(scaler, {false, false}), (std::vector<double>{16, 16}));
  EXPECT_EQ(scaler.state().hysteresis_left, 1);
  scaler.Update(false);  // Iteration 3: 3 - 0 = 3, grows and refills.
  EXPECT_EQ(scaler.scale(), 32.0);
  EXPECT_EQ(scaler.state().hysteresis_left, 2);
  scaler.Update(true);  // Tolerated again.
  EXPECT_EQ(scaler.scale(), 32.0);
  EXPECT_EQ(scaler.state().hysteresis_left, 1);
  scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 16.0);
}

TEST(LossScalerTest, NeverGoesBelowMinLossScale) {
  LossScaler scaler(Fp16(/*initial_scale_power=*/2, /*window=*/1000, /*hysteresis=*/1));
  EXPECT_EQ(ScalesAfter(scaler, {true, true, true, true}), (std::vector<double>{2, 1, 1, 1}));

  // A floor that is not a power of two: 4 -> max(2, 3) = 3 -> max(1.5, 3) = 3.
  LossScaler floored(Fp16(/*initial_scale_power=*/2, /*window=*/1000, /*hysteresis=*/1,
                          /*min_loss_scale=*/3.0));
  EXPECT_EQ(ScalesAfter(floored, {true, true, true}), (std::vector<double>{3, 3, 3}));

  // Growth from the floor doubles it.
  LossScaler grows(Fp16(/*initial_scale_power=*/2, /*window=*/2, /*hysteresis=*/1,
                        /*min_loss_scale=*/3.0));
  EXPECT_EQ(ScalesAfter(grows, {true, false, false, true, true}),
            (std::vector<double>{3, 3, 6, 3, 3}));

  // A floor below 1.
  LossScaler fractional(Fp16(/*initial_scale_power=*/0, /*window=*/1000, /*hysteresis=*/1,
                             /*min_loss_scale=*/0.25));
  EXPECT_EQ(ScalesAfter(fractional, {true, true, true}), (std::vector<double>{0.5, 0.25, 0.25}));
}

TEST(LossScalerTest, StaticScaleNeverChangesButChecksOverflow) {
  PrecisionOptions options = Fp16(/*initial_scale_power=*/16, /*window=*/1, /*hysteresis=*/1);
  options.loss_scale = 128.0;
  LossScaler scaler(options);
  EXPECT_EQ(scaler.scale(), 128.0);
  EXPECT_TRUE(scaler.checks_overflow());
  for (int i = 0; i < 20; ++i) {
    scaler.Update(i % 4 == 0);
    EXPECT_EQ(scaler.scale(), 128.0) << "after step " << i;
  }
  EXPECT_EQ(scaler.state().iteration, 20);

  options.loss_scale = 0.5;  // Any positive value, not only powers of two.
  EXPECT_EQ(LossScaler(options).scale(), 0.5);
}

TEST(LossScalerTest, StateRestoresIntoANewScaler) {
  const PrecisionOptions options = Fp16(/*initial_scale_power=*/10, /*window=*/4, /*hysteresis=*/2);
  LossScaler original(options);
  ScalesAfter(original, {true, false, false, true, false, false, false, false, true});
  const LossScalerState saved = original.state();
  EXPECT_EQ(
      saved,
      (LossScalerState{
          .scale = 1024.0, .iteration = 9, .last_overflow_iteration = 8, .hysteresis_left = 1}));

  LossScaler restored(options);
  EXPECT_NE(restored.state(), saved);
  restored.Restore(saved);
  EXPECT_EQ(restored.state(), saved);
  EXPECT_EQ(restored.scale(), 1024.0);

  // Both continue identically.
  const std::vector<bool> rest = {false, false, false, true, true, false, false, false, false};
  EXPECT_EQ(ScalesAfter(restored, rest), ScalesAfter(original, rest));
  EXPECT_EQ(restored.state(), original.state());
}

TEST(LossScalerTest, RestoreReplacesEveryField) {
  LossScaler scaler(Fp16(/*initial_scale_power=*/4, /*window=*/3, /*hysteresis=*/3));
  const LossScalerState state{
      .scale = 2.0, .iteration = 100, .last_overflow_iteration = 98, .hysteresis_left = 1};
  scaler.Restore(state);
  EXPECT_EQ(scaler.state(), state);
  EXPECT_EQ(scaler.scale(), 2.0);
  scaler.Update(false);  // 100 - 98 = 2: no growth.
  EXPECT_EQ(scaler.scale(), 2.0);
  scaler.Update(false);  // 101 - 98 = 3: grows and refills hysteresis to 3.
  EXPECT_EQ(
      scaler.state(),
      (LossScalerState{
          .scale = 4.0, .iteration = 102, .last_overflow_iteration = 98, .hysteresis_left = 3}));
}

/// A line-by-line transcription of DeepSpeed's DynamicLossScaler (consecutive_hysteresis=False).
struct DeepSpeedDynamicLossScaler {
  DeepSpeedDynamicLossScaler(int initial_scale_power, int window, int hysteresis, double floor)
      : cur_scale(static_cast<double>(int64_t{1} << initial_scale_power)),
        scale_window(window),
        min_scale(floor),
        delayed_shift(hysteresis),
        cur_hysteresis(hysteresis) {}

  void update_scale(bool overflow) {  // NOLINT(readability-identifier-naming)
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        cur_scale = std::max(cur_scale / 2, min_scale);
      } else {
        cur_hysteresis -= 1;
      }
      last_overflow_iter = cur_iter;
    } else {
      if ((cur_iter - last_overflow_iter) % scale_window == 0) {
        cur_hysteresis = delayed_shift;
        cur_scale *= 2;
      }
    }
    cur_iter += 1;
  }

  double cur_scale;
  int64_t cur_iter = 0;
  int64_t last_overflow_iter = -1;
  int64_t scale_window;
  double min_scale;
  int delayed_shift;
  int cur_hysteresis;
};

TEST(LossScalerTest, MatchesDeepSpeedOnRandomOverflowSequences) {
  struct Config {
    int initial_scale_power;
    int window;
    int hysteresis;
    double min_scale;
    double overflow_probability;
  };
  const Config configs[] = {
      {16, 1000, 2, 1.0, 0.01}, {16, 3, 2, 1.0, 0.2}, {8, 5, 1, 1.0, 0.3},
      {4, 2, 3, 2.0, 0.5},      {0, 1, 1, 1.0, 0.1},  {12, 7, 4, 0.5, 0.4},
      {20, 10, 2, 64.0, 0.9},   {1, 4, 2, 1.0, 0.25}, {30, 50, 5, 1.0, 0.05},
  };
  std::mt19937_64 rng(7);
  for (const Config& c : configs) {
    for (int seed = 0; seed < 4; ++seed) {
      SCOPED_TRACE("power " + std::to_string(c.initial_scale_power) + " window " +
                   std::to_string(c.window) + " hysteresis " + std::to_string(c.hysteresis) +
                   " min " + std::to_string(c.min_scale) + " p " +
                   std::to_string(c.overflow_probability) + " seed " + std::to_string(seed));
      std::bernoulli_distribution overflows(c.overflow_probability);
      LossScaler scaler(Fp16(c.initial_scale_power, c.window, c.hysteresis, c.min_scale));
      DeepSpeedDynamicLossScaler reference(c.initial_scale_power, c.window, c.hysteresis,
                                           c.min_scale);
      ASSERT_EQ(scaler.scale(), reference.cur_scale);
      for (int step = 0; step < 500; ++step) {
        const bool overflow = overflows(rng);
        scaler.Update(overflow);
        reference.update_scale(overflow);
        ASSERT_EQ(scaler.scale(), reference.cur_scale) << "step " << step;
        ASSERT_EQ(scaler.state().iteration, reference.cur_iter) << "step " << step;
        ASSERT_EQ(scaler.state().last_overflow_iteration, reference.last_overflow_iter)
            << "step " << step;
        ASSERT_EQ(scaler.state().hysteresis_left, reference.cur_hysteresis) << "step " << step;
      }
    }
  }
}

}  // namespace
}  // namespace strata::offload
