// The internal interface between the driver (cpu_optimizer.cpp) and the kernel translation
// units, one per instruction set: kernels_scalar.cpp (the reference), kernels_avx2.cpp and
// kernels_avx512.cpp. Each kernel TU fills one KernelTable; the driver picks a table at run time.
//
// Hazard: this header is compiled into TUs built with -mavx2 / -mavx512f. Anything here that
// the compiler may emit as a shared (COMDAT) function could be emitted with AVX-512
// instructions and then chosen by the linker for every caller, which breaks the binary on a CPU
// without AVX-512. So this header holds only plain aggregates (no default member initializers,
// which are inline constructors), constants and declarations — no inline functions and no
// templates. Shared code for the SIMD TUs lives in simd_kernels.inc, included inside an
// anonymous namespace so every TU gets private copies.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::cpu_adam::internal {

// The kernels are templates over these small integers, and the table is indexed by them.

/// Element type of an array, in the order of strata::DType.
constexpr int kElemFp32 = 0;
constexpr int kElemFp16 = 1;
constexpr int kElemBf16 = 2;
constexpr int kNumElemTypes = 3;

/// Element type of the optimizer states.
constexpr int kStateFp32 = 0;
constexpr int kStateBf16 = 1;
constexpr int kNumStateTypes = 2;

/// The parameter copy written out for the device.
constexpr int kCopyNone = 0;
constexpr int kCopyFp16 = 1;
constexpr int kCopyBf16 = 2;
constexpr int kNumCopyTypes = 3;

/// What a step kernel does to each element. The roofline kinds read and write exactly the
/// arrays of the optimizers named in their comments, with a trivial update, to measure the
/// memory-bandwidth limit for the same byte streams.
constexpr int kAdamW = 0;
constexpr int kAdam = 1;
constexpr int kAdagrad = 2;
constexpr int kLion = 3;
constexpr int kRooflineTwoStates = 4;  ///< params, grads, exp_avg, exp_avg_sq (AdamW, Adam).
constexpr int kRooflineExpAvg = 5;     ///< params, grads, exp_avg (Lion).
constexpr int kRooflineExpAvgSq = 6;   ///< params, grads, exp_avg_sq (Adagrad's sum).
constexpr int kNumUpdateKinds = 7;

/// Per-step scalars, computed once per call in double by the driver and rounded to float, as
/// torch.optim does when it hands Python floats to fp32 tensor kernels. Unused fields are 0.
struct Coefficients {
  float grad_scale;       ///< g = grad * grad_scale (loss-scale unscaling and clipping).
  float beta1;            ///< Adam: exp_avg decay. Lion: interpolation of the update sign.
  float one_minus_beta1;  ///< 1 - beta1.
  float beta2;            ///< Adam: exp_avg_sq decay. Lion: exp_avg decay.
  float one_minus_beta2;  ///< 1 - beta2.
  float l2_weight_decay;  ///< Adam, Adagrad: g += l2_weight_decay * p.
  float param_decay;      ///< AdamW, Lion: p *= param_decay, i.e. 1 - lr * weight_decay.
  float step_size;        ///< Adam(W): lr / (1 - beta1^t). Adagrad: lr / (1 + (t-1) lr_decay).
                          ///< Lion: lr.
  float bias_correction2_sqrt;      ///< Adam(W): sqrt(1 - beta2^t); 1 without bias correction.
  float inv_bias_correction2_sqrt;  ///< 1 / bias_correction2_sqrt.
  float eps;                        ///< Added to the denominator (Adam, Adagrad).
};

/// The arrays of one step, as untyped pointers whose element types are fixed by the kernel
/// chosen. Elementwise: element i of every array belongs to parameter i. Unused arrays are null.
/// The updated states go to the *_out arrays, which are the input arrays themselves for an
/// update in place, or arrays that do not overlap them.
struct KernelArgs {
  const float* params;     ///< fp32 master parameters, read.
  const void* grads;       ///< Gradients (fp32, fp16 or bf16), read.
  const void* exp_avg;     ///< First state (fp32 or bf16), read.
  const void* exp_avg_sq;  ///< Second state (fp32 or bf16), read.
  void* param_copy;        ///< fp16/bf16 copy of the updated params, written (streaming stores).
  Coefficients coefficients;
  float* params_out;     ///< Updated params, written.
  void* exp_avg_out;     ///< Updated first state, written.
  void* exp_avg_sq_out;  ///< Updated second state, written.
};

/// Updates elements [begin, end) of `args`.
using StepKernel = void (*)(const KernelArgs& args, size_t begin, size_t end);

/// Returns the sum of squares of elements [begin, end) of `grads`, accumulated in double (each
/// square is exact in double). Inf or NaN inputs make the result non-finite.
using SumOfSquaresKernel = double (*)(const void* grads, size_t begin, size_t end);

/// Blockwise quantization to int8 or int4 (CpuOptimizer::Quantize): blocks [first_block,
/// end_block) of `numel` elements of `in` (the last block may be short). Each block's scale is its
/// largest magnitude / L, L = 127 for 8 bits and 7 for 4, and each value is
/// round-to-nearest-even(x * (L / largest)). Values are one signed byte each at `values`, or, for
/// 4 bits, two a byte (quant_pack.inc), so block b starts at byte b * kQuantBlockElements * bits /
/// 8. A block holding a NaN or an infinity gets a NaN scale and values 0, so that all of it comes
/// back NaN (an fp16 overflow stays visible after a quantized reduction); a block whose largest
/// magnitude is below kQuantFlushBelow (zeros, say) gets scale 0 and values 0.
using QuantizeKernel = void (*)(const void* in, size_t numel, size_t first_block, size_t end_block,
                                int bits, float* scales, unsigned char* values);
/// The inverse: out = value * scale, in the element type of the table entry (rounded to nearest
/// even for the 16-bit types). A single multiplication, so every instruction set agrees.
using DequantizeKernel = void (*)(const unsigned char* values, int bits, const float* scales,
                                  size_t numel, size_t first_block, size_t end_block, void* out);

/// Elements per quantization block.
constexpr size_t kQuantBlockElements = 256;
/// Blocks smaller than this in magnitude are flushed to zeros: 127 / largest must not overflow.
constexpr float kQuantFlushBelow = 0x1p-100f;

/// Every kernel of one instruction set.
struct KernelTable {
  const char* name;
  StepKernel step[kNumUpdateKinds][kNumElemTypes][kNumStateTypes][kNumCopyTypes];
  SumOfSquaresKernel sum_of_squares[kNumElemTypes];
  QuantizeKernel quantize[kNumElemTypes];
  DequantizeKernel dequantize[kNumElemTypes];
};

/// Defined in kernels_scalar.cpp: plain C++ that reads like the formulas; the reference.
extern const KernelTable kScalarKernels;
/// Defined in kernels_avx2.cpp (AVX2 + FMA + F16C).
extern const KernelTable kAvx2Kernels;
/// Defined in kernels_avx512.cpp (AVX-512F + AVX2 + FMA + F16C).
extern const KernelTable kAvx512Kernels;

}  // namespace strata::cpu_adam::internal
