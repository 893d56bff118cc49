#include "strata/offload/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace strata::offload {

LossScaler::LossScaler(const PrecisionOptions& options) {
  if (options.working_dtype != DType::kFp16) return;  // Scale 1, no checks.
  checks_overflow_ = true;
  dynamic_ = options.loss_scale == 0.0;
  loss_scale_window_ = options.loss_scale_window;
  hysteresis_ = options.hysteresis;
  min_scale_ = options.min_loss_scale;
  state_.scale = dynamic_ ? std::ldexp(1.0, options.initial_scale_power) : options.loss_scale;
  state_.hysteresis_left = hysteresis_;
}

// DeepSpeed's DynamicLossScaler.update_scale, with consecutive_hysteresis=False (its default):
// hysteresis is refilled only when the scale grows.
void LossScaler::Update(bool overflow) {
  if (dynamic_) {
    if (overflow) {
      if (hysteresis_ == 1 || state_.hysteresis_left == 1) {
        state_.scale = std::max(state_.scale / 2.0, min_scale_);
      } else {
        --state_.hysteresis_left;
      }
      state_.last_overflow_iteration = state_.iteration;
    } else if ((state_.iteration - state_.last_overflow_iteration) % loss_scale_window_ == 0) {
      state_.hysteresis_left = hysteresis_;
      state_.scale *= 2.0;
    }
  }
  ++state_.iteration;
}

}  // namespace strata::offload
