// LossScaler: fp16 loss scaling with DeepSpeed's semantics and defaults.
//
// fp16 gradients underflow unless the loss is multiplied by a large scale before backward; the
// optimizer divides it out again. Dynamic scaling (DeepSpeed's DynamicLossScaler) starts at
// 2^initial_scale_power, halves the scale when gradients overflow (after `hysteresis` overflows
// in a row have been tolerated) and doubles it after loss_scale_window steps without one. An
// overflowing step is skipped: parameters and optimizer states are left untouched. A static
// scale (loss_scale > 0) never changes, but overflowing steps are still skipped.
//
// bf16 and fp32 need no scaling: their scale is 1 and steps are never skipped for overflow.
#pragma once

#include <cstdint>

#include "strata/core/options.h"

namespace strata::offload {

/// Everything that survives a checkpoint.
struct LossScalerState {
  double scale = 1.0;
  int64_t iteration = 0;  ///< Steps seen (skipped ones included).
  int64_t last_overflow_iteration = -1;
  int hysteresis_left = 1;  ///< Overflows still tolerated before the scale is halved.

  friend bool operator==(const LossScalerState&, const LossScalerState&) = default;
};

/// Not thread-safe: the engine calls it once per step, from the step's completion.
class LossScaler {
 public:
  explicit LossScaler(const PrecisionOptions& options);

  /// The scale the trainer multiplies its loss by for the next backward.
  double scale() const { return state_.scale; }
  /// Whether gradients must be checked for Inf/NaN before a step (fp16 only).
  bool checks_overflow() const { return checks_overflow_; }

  /// Records one step's outcome and adjusts the scale (dynamic scaling only).
  void Update(bool overflow);
  /// Whether an overflow now would have to lower a dynamic scale below min_loss_scale (it is
  /// there and the hysteresis is spent): DeepSpeed ends the run at such an overflow.
  bool AtMinimumScale() const {
    return dynamic_ && (hysteresis_ == 1 || state_.hysteresis_left == 1) &&
           state_.scale <= min_scale_;
  }

  const LossScalerState& state() const { return state_; }
  void Restore(const LossScalerState& state) { state_ = state; }

 private:
  bool checks_overflow_ = false;
  bool dynamic_ = false;
  int loss_scale_window_ = 1000;
  int hysteresis_ = 2;
  double min_scale_ = 1.0;
  LossScalerState state_;
};

}  // namespace strata::offload
