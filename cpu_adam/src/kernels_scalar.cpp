// The scalar reference: one element at a time, in plain C++ that reads like the formulas.
//
// Keep it forever. Every SIMD variant is tested against it, and it is the fallback on CPUs
// without AVX2. It is compiled with -ffp-contract=off so that `a * b + c` is two roundings, as
// written, whatever flags the build adds. Arithmetic is fp32, as torch.optim's fp32 kernels;
// the per-step scalars (Coefficients) were computed in double by the driver.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>

#include "kernels.h"
#include "strata/core/dtype.h"

namespace strata::cpu_adam::internal {
namespace {

// ---- One element in, one element out, by element type. ----

template <int kType>
float LoadElement(const void* array, size_t i) {
  if constexpr (kType == kElemFp32) return static_cast<const float*>(array)[i];
  if constexpr (kType == kElemFp16) return Fp16ToFp32(static_cast<const uint16_t*>(array)[i]);
  if constexpr (kType == kElemBf16) return Bf16ToFp32(static_cast<const uint16_t*>(array)[i]);
}

// Rounds to nearest even for the 16-bit types.
template <int kType>
void StoreElement(void* array, size_t i, float value) {
  if constexpr (kType == kElemFp32) static_cast<float*>(array)[i] = value;
  if constexpr (kType == kElemFp16) static_cast<uint16_t*>(array)[i] = Fp32ToFp16(value);
  if constexpr (kType == kElemBf16) static_cast<uint16_t*>(array)[i] = Fp32ToBf16(value);
}

constexpr int StateElement(int state) { return state == kStateFp32 ? kElemFp32 : kElemBf16; }
constexpr int CopyElement(int copy) { return copy == kCopyFp16 ? kElemFp16 : kElemBf16; }

/// sign(x): +1, -1, or 0 for zero (and NaN), as torch.sign.
float Sign(float x) { return static_cast<float>((x > 0.0f) - (x < 0.0f)); }

// ---- The update rules. Notation: p parameter, g gradient, t step, lr learning rate. ----

template <int kUpdate, int kGrad, int kState, int kCopy>
void StepKernelFor(const KernelArgs& args, size_t begin, size_t end) {
  constexpr int kStateType = StateElement(kState);
  const Coefficients& c = args.coefficients;
  for (size_t i = begin; i < end; ++i) {
    float p = args.params[i];
    float g = LoadElement<kGrad>(args.grads, i) * c.grad_scale;

    if constexpr (kUpdate == kAdamW || kUpdate == kAdam) {
      // Adam (Kingma & Ba), as torch.optim.Adam / AdamW:
      //   Adam:  g <- g + weight_decay * p            (L2 penalty joins the gradient)
      //   AdamW: p <- p * (1 - lr * weight_decay)     (decoupled weight decay)
      //   m <- beta1 * m + (1 - beta1) * g
      //   v <- beta2 * v + (1 - beta2) * g^2
      //   p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
      // Without bias correction both (1 - beta^t) factors are 1.
      float m = LoadElement<kStateType>(args.exp_avg, i);
      float v = LoadElement<kStateType>(args.exp_avg_sq, i);
      if constexpr (kUpdate == kAdam) g = g + c.l2_weight_decay * p;
      if constexpr (kUpdate == kAdamW) p = p * c.param_decay;
      m = c.beta1 * m + c.one_minus_beta1 * g;
      v = c.beta2 * v + c.one_minus_beta2 * g * g;
      const float denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
      p = p - c.step_size * (m / denom);
      StoreElement<kStateType>(args.exp_avg_out, i, m);
      StoreElement<kStateType>(args.exp_avg_sq_out, i, v);
    } else if constexpr (kUpdate == kAdagrad) {
      // Adagrad (Duchi et al.), as torch.optim.Adagrad; the sum lives in exp_avg_sq:
      //   g <- g + weight_decay * p
      //   sum <- sum + g^2
      //   p <- p - lr / (1 + (t - 1) * lr_decay) * g / (sqrt(sum) + eps)
      float sum = LoadElement<kStateType>(args.exp_avg_sq, i);
      g = g + c.l2_weight_decay * p;
      sum = sum + g * g;
      const float denom = std::sqrt(sum) + c.eps;
      p = p - c.step_size * (g / denom);
      StoreElement<kStateType>(args.exp_avg_sq_out, i, sum);
    } else if constexpr (kUpdate == kLion) {
      // Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), Algorithm 2:
      //   update <- sign(beta1 * m + (1 - beta1) * g)
      //   p <- p * (1 - lr * weight_decay) - lr * update
      //   m <- beta2 * m + (1 - beta2) * g
      float m = LoadElement<kStateType>(args.exp_avg, i);
      const float update = Sign(c.beta1 * m + c.one_minus_beta1 * g);
      p = p * c.param_decay - c.step_size * update;
      m = c.beta2 * m + c.one_minus_beta2 * g;
      StoreElement<kStateType>(args.exp_avg_out, i, m);
    } else {
      // Roofline: the same loads and stores as the optimizer, with a trivial update.
      p = p + g;
      if constexpr (kUpdate == kRooflineTwoStates || kUpdate == kRooflineExpAvg) {
        StoreElement<kStateType>(args.exp_avg_out, i, LoadElement<kStateType>(args.exp_avg, i) + 1);
      }
      if constexpr (kUpdate == kRooflineTwoStates || kUpdate == kRooflineExpAvgSq) {
        StoreElement<kStateType>(args.exp_avg_sq_out, i,
                                 LoadElement<kStateType>(args.exp_avg_sq, i) + 1);
      }
    }

    args.params_out[i] = p;
    if constexpr (kCopy != kCopyNone) StoreElement<CopyElement(kCopy)>(args.param_copy, i, p);
  }
}

template <int kGrad>
double SumOfSquaresFor(const void* grads, size_t begin, size_t end) {
  double sum = 0.0;
  for (size_t i = begin; i < end; ++i) {
    const double g = LoadElement<kGrad>(grads, i);
    sum += g * g;
  }
  return sum;
}

#include "quant_pack.inc"

template <int kElem>
void QuantizeFor(const void* in, size_t numel, size_t first_block, size_t end_block, int bits,
                 float* scales, unsigned char* values) {
  const float levels = QuantLevels(bits);
  for (size_t b = first_block; b < end_block; ++b) {
    const size_t begin = b * kQuantBlockElements;
    const size_t end = std::min(begin + kQuantBlockElements, numel);
    // 8 bits are written in place; 4 bits one a byte here, then packed.
    signed char staged[kQuantBlockElements];
    signed char* out = staged;
    if (bits == 8) out = reinterpret_cast<signed char*>(values) + begin;
    float largest = 0.0f;
    bool finite = true;
    for (size_t i = begin; i < end; ++i) {
      const float x = LoadElement<kElem>(in, i);
      finite = finite && std::isfinite(x);
      largest = std::max(largest, std::fabs(x));
    }
    if (!finite || largest < kQuantFlushBelow) {
      scales[b] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      std::fill(out, out + (end - begin), static_cast<signed char>(0));
    } else {
      scales[b] = largest / levels;
      const float inverse = levels / largest;
      for (size_t i = begin; i < end; ++i) {
        // Default rounding: to nearest even, as the SIMD conversions.
        const float q = std::nearbyint(LoadElement<kElem>(in, i) * inverse);
        out[i - begin] = static_cast<signed char>(std::clamp(q, -128.0f, 127.0f));
      }
    }
    if (bits == 4) PackInt4(staged, end - begin, values + begin / 2);
  }
}

template <int kElem>
void DequantizeFor(const unsigned char* values, int bits, const float* scales, size_t numel,
                   size_t first_block, size_t end_block, void* out) {
  for (size_t b = first_block; b < end_block; ++b) {
    const size_t begin = b * kQuantBlockElements;
    const size_t end = std::min(begin + kQuantBlockElements, numel);
    signed char staged[kQuantBlockElements];
    const signed char* q = staged;
    if (bits == 8) {
      q = reinterpret_cast<const signed char*>(values) + begin;
    } else {
      UnpackInt4(values + begin / 2, end - begin, staged);
    }
    for (size_t i = begin; i < end; ++i) {
      StoreElement<kElem>(out, i, static_cast<float>(q[i - begin]) * scales[b]);
    }
  }
}

#include "kernel_table.inc"

}  // namespace

constexpr KernelTable kScalarKernels = MakeKernelTable("scalar");

}  // namespace strata::cpu_adam::internal
