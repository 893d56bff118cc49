// CpuOptimizer: vectorized optimizer steps on the CPU, at the memory-bandwidth limit.
//
// One call updates a flat group of parameters (a chunk) in a single pass over memory: it reads
// the fp32 master parameters, the gradients and the optimizer states, and writes back the
// parameters, the states and, optionally, an fp16/bf16 copy of the parameters for the device.
// The optimizers are AdamW, Adam, Adagrad and Lion, with the semantics (and defaults) of
// torch.optim.AdamW, torch.optim.Adam, torch.optim.Adagrad and the Lion paper. Hyper-parameters
// are passed on every call, so learning-rate schedules need nothing special.
//
//   STRATA_ASSIGN_OR_RETURN(CpuOptimizer optimizer, CpuOptimizer::Create({.threads = 0}));
//   // Global-norm clipping and the fp16 overflow check: one read-only pass over the gradients.
//   STRATA_ASSIGN_OR_RETURN(GradientStats stats,
//                           optimizer.ComputeGradientStats(g, DType::kFp16, n));
//   if (!stats.all_finite) return SkipStep();  // Lower the loss scale and try again.
//   const double norm = std::sqrt(stats.sum_of_squares) / loss_scale;
//   const double clip = std::min(1.0, max_norm / (norm + 1e-6));
//   // The step: unscaling and clipping ride along in grad_scale; no extra pass.
//   STRATA_RETURN_IF_ERROR(optimizer.Step(
//       AdamWHyperParams{.lr = schedule(t), .step = t, .grad_scale = clip / loss_scale},
//       StepBuffers{.numel = n, .params = p, .grads = g, .grad_dtype = DType::kFp16,
//                   .exp_avg = m, .exp_avg_sq = v, .param_copy = p16}));
//
// Precision: arithmetic is fp32, like torch.optim's fp32 kernels. Master parameters are always
// fp32. States are fp32, or bf16 to halve their bytes: bf16 keeps fp32's range but only 8
// significant bits, so each step rounds m and v to between 2 and 3 decimal digits (relative
// error up to 2^-8). That is lower precision than PyTorch's fp32 states; use it knowingly.
//
// Work is split into kBlockElements-aligned contiguous ranges, one per thread of the optimizer's
// oneTBB arena (static partitioning). Results do not depend on the thread count: updates are
// elementwise, and ComputeGradientStats reduces per block in a fixed order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "strata/core/dtype.h"
#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/simd.h"

namespace strata::cpu_adam {

/// Elements per block: the unit of partitioning between threads and of the gradient-norm
/// reduction. A multiple of 64, so with 64-byte aligned arrays no two threads share a cache line.
inline constexpr size_t kBlockElements = size_t{64} * 1024;

/// Blockwise quantization (ZeRO++'s quantized weights and gradients, CpuOptimizer::Quantize):
/// values in blocks of this many elements share one fp32 scale.
inline constexpr size_t kQuantBlockElements = 256;
static_assert(kBlockElements % kQuantBlockElements == 0);

/// Whether `bits` is a width Quantize writes: 8 (int8) or 4 (int4, two values a byte).
constexpr bool IsQuantBits(int bits) { return bits == 8 || bits == 4; }

/// Bytes of `numel` values quantized to `bits` (IsQuantBits): one fp32 scale per block of
/// kQuantBlockElements (the largest magnitude / 127, or / 7 for 4 bits), then the values, one a
/// byte or two a byte, rounded up to 4 bytes.
constexpr size_t QuantizedBytes(size_t numel, int bits) {
  const size_t blocks = (numel + kQuantBlockElements - 1) / kQuantBlockElements;
  const size_t value_bytes = (numel * size_t(bits) + 7) / 8;
  return blocks * sizeof(float) + (value_bytes + 3) / 4 * 4;
}

/// AdamW (Loshchilov & Hutter), as torch.optim.AdamW: weight decay is decoupled from the
/// gradient, p <- p * (1 - lr * weight_decay), before the Adam update. Defaults are torch's.
struct AdamWHyperParams {
  /// Learning rate, >= 0.
  double lr = 1e-3;
  /// Decay of exp_avg (the first moment), in [0, 1).
  double beta1 = 0.9;
  /// Decay of exp_avg_sq (the second moment), in [0, 1).
  double beta2 = 0.999;
  /// Added to the denominator for numerical stability, >= 0.
  double eps = 1e-8;
  /// Decoupled weight decay, >= 0.
  double weight_decay = 1e-2;
  /// Divide the moments by (1 - beta^step) as torch does. DeepSpeed's bias_correction=false
  /// turns it off.
  bool bias_correction = true;
  /// The number of this step, counting from 1 (torch's state["step"] after its increment).
  /// Must be >= 1 when bias_correction is on.
  int64_t step = 1;
  /// Every gradient element is multiplied by this before use, in the same pass: 1/loss_scale
  /// times the global-norm clipping coefficient. Finite.
  double grad_scale = 1.0;
};

/// Adam (Kingma & Ba), as torch.optim.Adam: weight decay is an L2 penalty added to the
/// gradient, g <- g + weight_decay * p. Fields as AdamWHyperParams; torch's defaults.
struct AdamHyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  int64_t step = 1;
  double grad_scale = 1.0;
};

/// Adagrad (Duchi et al.), as torch.optim.Adagrad. Its one state, the running sum of squared
/// gradients, lives in StepBuffers::exp_avg_sq; torch's initial_accumulator_value is the value
/// that buffer is filled with before the first step (CpuOptimizer::Fill). Defaults are torch's.
struct AdagradHyperParams {
  /// Learning rate, >= 0; step t uses lr / (1 + (t - 1) * lr_decay).
  double lr = 1e-2;
  /// Learning-rate decay, >= 0.
  double lr_decay = 0.0;
  /// L2 penalty added to the gradient, >= 0.
  double weight_decay = 0.0;
  /// Added to the denominator, >= 0.
  double eps = 1e-10;
  /// The number of this step, counting from 1.
  int64_t step = 1;
  /// Multiplies every gradient element before use (see AdamWHyperParams::grad_scale).
  double grad_scale = 1.0;
};

/// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): p moves by
/// lr * sign(beta1 * m + (1 - beta1) * g), with decoupled weight decay; then
/// m <- beta2 * m + (1 - beta2) * g. Its one state lives in StepBuffers::exp_avg. Defaults are
/// the paper's (and lion-pytorch's). Lion's lr is typically 3-10x smaller than AdamW's.
struct LionHyperParams {
  /// Learning rate, >= 0.
  double lr = 1e-4;
  /// Interpolation between the momentum and the gradient for the update's sign, in [0, 1].
  double beta1 = 0.9;
  /// Decay of the momentum exp_avg, in [0, 1].
  double beta2 = 0.99;
  /// Decoupled weight decay, >= 0.
  double weight_decay = 0.0;
  /// Multiplies every gradient element before use (see AdamWHyperParams::grad_scale).
  double grad_scale = 1.0;
};

/// The arrays of one step: `numel` elements each, element i of every array belonging to
/// parameter i. Views: the caller owns the memory, which must stay valid during the call. Arrays
/// must be aligned to their element size and must not overlap. Arrays an optimizer does not use
/// (exp_avg for Adagrad, exp_avg_sq for Lion) are ignored and may be null.
struct StepBuffers {
  /// Number of elements; 0 makes a step a no-op.
  size_t numel = 0;
  /// fp32 master parameters, updated in place (or into params_out).
  float* params = nullptr;
  /// Gradients, read only.
  const void* grads = nullptr;
  /// fp32, fp16 or bf16.
  DType grad_dtype = DType::kFp32;
  /// First moment (AdamW, Adam, Lion), updated in place.
  void* exp_avg = nullptr;
  /// Second moment (AdamW, Adam) or sum of squares (Adagrad), updated in place.
  void* exp_avg_sq = nullptr;
  /// fp32, or bf16 for half the state bytes at lower precision (see the top of this file).
  DType state_dtype = DType::kFp32;
  /// Optional: receives the updated parameters rounded to param_copy_dtype (nearest even),
  /// written with streaming stores that bypass the caches. Null for no copy.
  void* param_copy = nullptr;
  /// fp16 or bf16.
  DType param_copy_dtype = DType::kBf16;
  /// Optional: where the updated params, exp_avg and exp_avg_sq go instead of back into their
  /// inputs, which then stay unchanged (an update that can be undone at no cost). Each is null
  /// (that array is updated in place) or an array of the same type and length that does not
  /// overlap any input. Reads and writes the same bytes as an update in place.
  float* params_out = nullptr;
  void* exp_avg_out = nullptr;
  void* exp_avg_sq_out = nullptr;
};

/// What ComputeGradientStats found.
struct GradientStats {
  /// Sum of the squares of all elements, accumulated in double. The global L2 norm of several
  /// buffers is the square root of the sum of their sums. Non-finite when all_finite is false.
  double sum_of_squares = 0.0;
  /// False when any element is Inf or NaN (e.g. an fp16 overflow: skip the step).
  bool all_finite = true;
  /// When asked for: a 64-bit xxHash (XXH3) of the gradients' bytes, taken block by block while
  /// each block is in cache from the sum and combined in block order, so equal bytes give the
  /// same value whatever the thread count. Compared later, it tells whether someone changed the
  /// gradients since (a multiplication by exactly 1 does not). 0 when not asked for.
  uint64_t checksum = 0;
};

struct CpuOptimizerOptions {
  /// Threads of the optimizer's oneTBB arena, including the calling thread; 0 = all hardware
  /// threads available to the process. Must be >= 0.
  int threads = 0;
  /// Kernel build to run; nullopt = the STRATA_SIMD environment variable if set, else the best
  /// this CPU supports (see ResolveSimdLevel).
  std::optional<SimdLevel> simd = std::nullopt;

  /// InvalidArgument for a negative thread count.
  Status Validate() const;
};

/// Runs optimizer steps and gradient reductions on a oneTBB arena of its own.
///
/// Thread safety: all methods may be called concurrently; concurrent calls share the arena's
/// threads. Each call blocks until its work is done. Move-only.
class CpuOptimizer {
 public:
  /// Errors: InvalidArgument for bad options; Unavailable when the requested SIMD level needs
  /// instructions this CPU lacks.
  static Result<CpuOptimizer> Create(const CpuOptimizerOptions& options = {});

  CpuOptimizer(CpuOptimizer&& other) noexcept;
  CpuOptimizer& operator=(CpuOptimizer&& other) noexcept;
  ~CpuOptimizer();

  /// The kernel build this optimizer runs.
  SimdLevel simd_level() const;
  /// The number of threads of its arena.
  int threads() const;

  /// One optimizer step over `buffers`. InvalidArgument (naming the field) for a bad
  /// hyper-parameter, a missing or misaligned array, or an unsupported dtype; nothing is
  /// written then. Non-finite gradients are not detected here (see ComputeGradientStats).
  Status Step(const AdamWHyperParams& hyper_params, const StepBuffers& buffers);
  Status Step(const AdamHyperParams& hyper_params, const StepBuffers& buffers);
  Status Step(const AdagradHyperParams& hyper_params, const StepBuffers& buffers);
  Status Step(const LionHyperParams& hyper_params, const StepBuffers& buffers);

  /// For benchmarks: reads and writes exactly the arrays, bytes and streams that Step for
  /// `type` would (same vector width, threads and partitioning, streaming stores for the copy),
  /// with a trivial update instead of the optimizer's arithmetic: the memory-bandwidth roofline
  /// of that step. Leaves meaningless values in every array it writes.
  Status RooflineStep(OptimizerType type, const StepBuffers& buffers);

  /// Sum of squares of `numel` gradient elements and whether all are finite, in one vectorized
  /// parallel pass. Reproducible: the result depends on the SIMD level but not on the thread
  /// count. InvalidArgument for a null or misaligned buffer. `checksum`: fill
  /// GradientStats::checksum too, in the same pass.
  Result<GradientStats> ComputeGradientStats(const void* grads, DType dtype, size_t numel,
                                             bool checksum = false);

  /// Sets `numel` elements of `data` to `value` (rounded to `dtype`), with the same threads and
  /// partitioning as Step, so that pages are first touched by the threads that will update them.
  /// Use it to zero new optimizer states, or to apply Adagrad's initial_accumulator_value.
  Status Fill(void* data, DType dtype, size_t numel, float value);

  /// Quantizes `numel` values of `dtype` into QuantizedBytes(numel, bits) bytes at `out` (4-byte
  /// aligned): each block's values become round(x * L / largest magnitude) in [-L, L], L = 127
  /// for 8 bits and 7 for 4. The error of a value is at most 1/(2L) of its block's largest. A
  /// block holding a NaN or an infinity comes back all NaN (overflow checks after a quantized
  /// reduction still see it); a block below 2^-100 in magnitude comes back zeros.
  /// InvalidArgument for a null or misaligned buffer, or bits other than 8 and 4.
  Status Quantize(const void* in, DType dtype, size_t numel, int bits, std::byte* out);
  /// The inverse, into `numel` values of `dtype`: value * scale, one multiplication rounded to
  /// `dtype`, so every SIMD level and every rank gets the same bits from the same bytes.
  Status Dequantize(const std::byte* in, int bits, size_t numel, void* out, DType dtype);

  /// Calls `body(begin, end)` for the contiguous, kBlockElements-aligned element ranges that
  /// Step would give its threads, in the arena; returns when all calls have returned. Small
  /// sizes run on the calling thread.
  void ParallelFor(size_t numel, const std::function<void(size_t begin, size_t end)>& body);

 private:
  struct Impl;
  explicit CpuOptimizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::cpu_adam
