// Test helpers for cpu_adam: the arrays of one step filled with reproducible random values,
// surrounded by guard elements that catch writes outside [0, numel), and placed at an element
// offset so that starts are not vector-aligned.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/cpu_adam/cpu_optimizer.h"

namespace strata::cpu_adam::testing {

/// The SIMD levels this CPU can run, scalar first.
inline std::vector<SimdLevel> SupportedLevels() {
  std::vector<SimdLevel> levels;
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (SimdLevelSupported(level, DetectCpuFeatures())) levels.push_back(level);
  }
  return levels;
}

inline float ToFloat(DType dtype, const void* array, size_t i) {
  switch (dtype) {
    case DType::kFp32: return static_cast<const float*>(array)[i];
    case DType::kFp16: return Fp16ToFp32(static_cast<const uint16_t*>(array)[i]);
    case DType::kBf16: return Bf16ToFp32(static_cast<const uint16_t*>(array)[i]);
  }
  return NAN;
}

inline void FromFloat(DType dtype, void* array, size_t i, float value) {
  switch (dtype) {
    case DType::kFp32: static_cast<float*>(array)[i] = value; break;
    case DType::kFp16: static_cast<uint16_t*>(array)[i] = Fp32ToFp16(value); break;
    case DType::kBf16: static_cast<uint16_t*>(array)[i] = Fp32ToBf16(value); break;
  }
}

/// One array of `numel` elements of `dtype`, starting `offset` elements past an 64-byte
/// aligned address, with kGuard guard elements on each side.
class GuardedArray {
 public:
  static constexpr size_t kGuard = 40;
  static constexpr uint8_t kGuardByte = 0xA5;

  GuardedArray() = default;
  GuardedArray(DType dtype, size_t numel, size_t offset)
      : dtype_(dtype), numel_(numel), offset_(offset) {
    const size_t bytes = (numel + 2 * kGuard + offset) * DTypeSize(dtype) + 64;
    storage_.assign(bytes, kGuardByte);
  }

  DType dtype() const { return dtype_; }
  size_t numel() const { return numel_; }
  void* data() { return Base() + (kGuard + offset_) * DTypeSize(dtype_); }
  const void* data() const { return const_cast<GuardedArray*>(this)->data(); }

  float Get(size_t i) const { return ToFloat(dtype_, data(), i); }
  void Set(size_t i, float value) { FromFloat(dtype_, data(), i, value); }
  uint32_t Bits(size_t i) const {
    if (dtype_ == DType::kFp32) {
      uint32_t bits;
      std::memcpy(&bits, static_cast<const float*>(data()) + i, 4);
      return bits;
    }
    return static_cast<const uint16_t*>(data())[i];
  }

  /// True when every guard byte still holds kGuardByte.
  bool GuardsIntact() const {
    const size_t element = DTypeSize(dtype_);
    const auto* base = const_cast<GuardedArray*>(this)->Base();
    const size_t before = (kGuard + offset_) * element;
    const size_t after_begin = before + numel_ * element;
    const size_t after_end = after_begin + kGuard * element;
    for (size_t i = 0; i < before; ++i) {
      if (base[i] != kGuardByte) return false;
    }
    for (size_t i = after_begin; i < after_end; ++i) {
      if (base[i] != kGuardByte) return false;
    }
    return true;
  }

 private:
  uint8_t* Base() {
    const auto address = reinterpret_cast<uintptr_t>(storage_.data());
    return storage_.data() + (64 - address % 64) % 64;
  }

  DType dtype_ = DType::kFp32;
  size_t numel_ = 0;
  size_t offset_ = 0;
  std::vector<uint8_t> storage_;
};

/// Everything one step reads and writes. Two StepArrays built with the same arguments hold the
/// same values, so two implementations can be run side by side.
struct StepArrays {
  GuardedArray params, grads, exp_avg, exp_avg_sq, param_copy;
  bool has_copy = false;

  /// Values like those of a model in training: params in [-1, 1], gradients of scale 1e-2
  /// (with a sprinkling of exact zeros), a first moment of the gradients' scale and a positive
  /// second moment of their square's scale. `offset` shifts every array's start (and the copy's
  /// by a different amount, so its alignment differs from the others').
  StepArrays(size_t numel, DType grad_dtype, DType state_dtype, std::optional<DType> copy_dtype,
             size_t offset, uint32_t seed)
      : params(DType::kFp32, numel, offset),
        grads(grad_dtype, numel, offset),
        exp_avg(state_dtype, numel, offset),
        exp_avg_sq(state_dtype, numel, offset),
        param_copy(copy_dtype.value_or(DType::kBf16), copy_dtype ? numel : 0, offset * 3 + 1),
        has_copy(copy_dtype.has_value()) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < numel; ++i) {
      params.Set(i, unit(rng));
      grads.Set(i, i % 97 == 5 ? 0.0f : 1e-2f * normal(rng));
      exp_avg.Set(i, 1e-2f * normal(rng));
      const float g = 1e-2f * normal(rng);
      exp_avg_sq.Set(i, g * g + 1e-6f * std::abs(unit(rng)));
      if (has_copy) param_copy.Set(i, 0.0f);
    }
  }

  StepBuffers buffers() {
    return {.numel = params.numel(),
            .params = static_cast<float*>(params.data()),
            .grads = grads.data(),
            .grad_dtype = grads.dtype(),
            .exp_avg = exp_avg.data(),
            .exp_avg_sq = exp_avg_sq.data(),
            .state_dtype = exp_avg.dtype(),
            .param_copy = has_copy ? param_copy.data() : nullptr,
            .param_copy_dtype = param_copy.dtype()};
  }

  bool GuardsIntact() const {
    return params.GuardsIntact() && grads.GuardsIntact() && exp_avg.GuardsIntact() &&
           exp_avg_sq.GuardsIntact() && param_copy.GuardsIntact();
  }
};

/// The largest relative difference between two arrays: |a - b| / max(|b|, mean |b|). Elements
/// far smaller than the array's typical magnitude are judged against that magnitude, since
/// after a cancellation (beta1 * m + (1 - beta1) * g near zero) a pure relative difference
/// measures nothing. Also returns where it occurred.
struct Difference {
  double relative = 0.0;
  size_t index = 0;
  std::string ToString() const {
    return std::to_string(relative) + " at element " + std::to_string(index);
  }
};

inline Difference MaxRelativeDifference(const GuardedArray& actual, const GuardedArray& expected) {
  const size_t n = expected.numel();
  double mean = 0.0;
  for (size_t i = 0; i < n; ++i) mean += std::abs(expected.Get(i));
  mean = n > 0 ? mean / static_cast<double>(n) : 0.0;
  Difference worst;
  for (size_t i = 0; i < n; ++i) {
    const double a = actual.Get(i);
    const double b = expected.Get(i);
    double relative = 0.0;
    if (a != b) {
      const double scale = std::max(std::abs(b), mean);
      relative = scale > 0 ? std::abs(a - b) / scale : INFINITY;
      if (std::isnan(a) || std::isnan(b)) relative = INFINITY;
    }
    if (relative > worst.relative) worst = {relative, i};
  }
  return worst;
}

}  // namespace strata::cpu_adam::testing
