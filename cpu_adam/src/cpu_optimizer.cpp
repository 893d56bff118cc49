// The driver: validates a call, turns hyper-parameters into per-step coefficients, picks the
// kernel for the dtypes and SIMD level, and runs it over static, block-aligned ranges on a
// oneTBB arena.
#include "strata/cpu_adam/cpu_optimizer.h"

#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"

namespace strata::cpu_adam {
namespace {

using internal::Coefficients;
using internal::KernelArgs;
using internal::KernelTable;

const KernelTable& KernelsFor(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512: return internal::kAvx512Kernels;
    case SimdLevel::kAvx2: return internal::kAvx2Kernels;
    case SimdLevel::kScalar: break;
  }
  return internal::kScalarKernels;
}

std::string FormatNumber(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

std::string_view DisplayName(OptimizerType type) {
  switch (type) {
    case OptimizerType::kAdamW: return "AdamW";
    case OptimizerType::kAdam: return "Adam";
    case OptimizerType::kAdagrad: return "Adagrad";
    case OptimizerType::kLion: return "Lion";
  }
  return "optimizer";
}

// ---- Validation. Every message says which optimizer, which field, and what was wrong. ----

class Checker {
 public:
  explicit Checker(OptimizerType type) : prefix_(std::string(DisplayName(type)) + " step: ") {}

  /// low <= value < high (or <= high when high_inclusive), and finite.
  Status InRange(const char* field, double value, double low, double high,
                 bool high_inclusive) const {
    const bool ok =
        std::isfinite(value) && value >= low && (high_inclusive ? value <= high : value < high);
    if (ok) return Status::Ok();
    return InvalidArgument(prefix_ + field + " must be in [" + FormatNumber(low) + ", " +
                           FormatNumber(high) + (high_inclusive ? "]" : ")") + ", got " +
                           FormatNumber(value));
  }

  Status NonNegative(const char* field, double value) const {
    if (std::isfinite(value) && value >= 0) return Status::Ok();
    return InvalidArgument(prefix_ + field + " must be finite and >= 0, got " +
                           FormatNumber(value));
  }

  Status Finite(const char* field, double value) const {
    if (std::isfinite(value)) return Status::Ok();
    return InvalidArgument(prefix_ + field + " must be finite, got " + FormatNumber(value));
  }

  Status PositiveStep(int64_t step) const {
    if (step >= 1) return Status::Ok();
    return InvalidArgument(prefix_ + "step must be >= 1 (steps count from 1), got " +
                           std::to_string(step));
  }

  Status Array(const char* field, const void* data, DType dtype, size_t numel) const {
    if (data == nullptr) {
      return InvalidArgument(prefix_ + field + " is null but numel is " + std::to_string(numel));
    }
    if (reinterpret_cast<uintptr_t>(data) % DTypeSize(dtype) != 0) {
      return InvalidArgument(prefix_ + field + " is not aligned to its element size (" +
                             std::to_string(DTypeSize(dtype)) + " bytes for " +
                             std::string(DTypeName(dtype)) + ")");
    }
    return Status::Ok();
  }

  Status Fail(const std::string& message) const { return InvalidArgument(prefix_ + message); }

 private:
  std::string prefix_;
};

Status ValidateBuffers(OptimizerType type, const StepBuffers& b) {
  const Checker check(type);
  if (b.numel == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(check.Array("params", b.params, DType::kFp32, b.numel));
  STRATA_RETURN_IF_ERROR(check.Array("grads", b.grads, b.grad_dtype, b.numel));
  if (b.state_dtype != DType::kFp32 && b.state_dtype != DType::kBf16) {
    return check.Fail("state_dtype " + std::string(DTypeName(b.state_dtype)) +
                      " is not supported (fp16's range is too small for squared gradients); "
                      "use fp32 or bf16");
  }
  if (UsesExpAvg(type)) {
    STRATA_RETURN_IF_ERROR(check.Array("exp_avg", b.exp_avg, b.state_dtype, b.numel));
  }
  if (UsesExpAvgSq(type)) {
    STRATA_RETURN_IF_ERROR(check.Array("exp_avg_sq", b.exp_avg_sq, b.state_dtype, b.numel));
  }
  // Outputs apart from the inputs: the same shape, and no overlap with any input (one shifted
  // against an input would have the update read elements it already wrote).
  struct Output {
    const char* name;
    const void* array;
    DType dtype;
    bool used;
  };
  const Output outputs[] = {
      {"params_out", b.params_out, DType::kFp32, true},
      {"exp_avg_out", b.exp_avg_out, b.state_dtype, UsesExpAvg(type)},
      {"exp_avg_sq_out", b.exp_avg_sq_out, b.state_dtype, UsesExpAvgSq(type)}};
  const std::pair<const void*, size_t> inputs[] = {
      {b.params, b.numel * sizeof(float)},
      {b.grads, b.numel * DTypeSize(b.grad_dtype)},
      {b.exp_avg, b.numel * DTypeSize(b.state_dtype)},
      {b.exp_avg_sq, b.numel * DTypeSize(b.state_dtype)}};
  for (const Output& out : outputs) {
    if (out.array == nullptr) continue;
    if (!out.used) {
      return check.Fail(std::string(out.name) + " is given but this optimizer has no such state");
    }
    STRATA_RETURN_IF_ERROR(check.Array(out.name, out.array, out.dtype, b.numel));
    const auto begin = reinterpret_cast<uintptr_t>(out.array);
    const auto end = begin + b.numel * DTypeSize(out.dtype);
    for (const auto& [input, input_bytes] : inputs) {
      const auto other = reinterpret_cast<uintptr_t>(input);
      if (input != nullptr && begin < other + input_bytes && other < end) {
        return check.Fail(std::string(out.name) +
                          " overlaps an input array; give arrays apart from the inputs, or null "
                          "to update in place");
      }
    }
  }
  if (b.param_copy != nullptr) {
    if (b.param_copy_dtype == DType::kFp32) {
      return check.Fail("param_copy_dtype must be fp16 or bf16 (params already is the fp32 copy)");
    }
    STRATA_RETURN_IF_ERROR(check.Array("param_copy", b.param_copy, b.param_copy_dtype, b.numel));
  }
  return Status::Ok();
}

// ---- Coefficients: computed in double, rounded to float once. ----

Coefficients AdamCoefficients(double lr, double beta1, double beta2, double eps,
                              bool bias_correction, int64_t step, double grad_scale) {
  const auto t = static_cast<double>(step);
  const double bias_correction1 = bias_correction ? 1.0 - std::pow(beta1, t) : 1.0;
  const double bias_correction2 = bias_correction ? 1.0 - std::pow(beta2, t) : 1.0;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  Coefficients c{};
  c.grad_scale = static_cast<float>(grad_scale);
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.l2_weight_decay = 0.0f;
  c.param_decay = 1.0f;
  c.step_size = static_cast<float>(lr / bias_correction1);
  c.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
  c.inv_bias_correction2_sqrt = static_cast<float>(1.0 / bias_correction2_sqrt);
  c.eps = static_cast<float>(eps);
  return c;
}

template <typename HyperParams>
Status ValidateAdam(OptimizerType type, const HyperParams& h) {
  const Checker check(type);
  STRATA_RETURN_IF_ERROR(check.NonNegative("lr", h.lr));
  STRATA_RETURN_IF_ERROR(check.InRange("beta1", h.beta1, 0.0, 1.0, /*high_inclusive=*/false));
  STRATA_RETURN_IF_ERROR(check.InRange("beta2", h.beta2, 0.0, 1.0, /*high_inclusive=*/false));
  STRATA_RETURN_IF_ERROR(check.NonNegative("eps", h.eps));
  STRATA_RETURN_IF_ERROR(check.NonNegative("weight_decay", h.weight_decay));
  if (h.bias_correction) STRATA_RETURN_IF_ERROR(check.PositiveStep(h.step));
  return check.Finite("grad_scale", h.grad_scale);
}

}  // namespace

// ---- Options ----

Status CpuOptimizerOptions::Validate() const {
  if (threads < 0) {
    return InvalidArgument(
        "CpuOptimizerOptions.threads must be >= 0 (0 = all hardware threads), "
        "got " +
        std::to_string(threads));
  }
  return Status::Ok();
}

// ---- The driver ----

struct CpuOptimizer::Impl {
  Impl(SimdLevel simd_level, int thread_count)
      : level(simd_level),
        kernels(&KernelsFor(simd_level)),
        threads(thread_count),
        arena(thread_count) {}

  /// Calls body(begin, end) once per part: `parts` contiguous, block-aligned ranges covering
  /// [0, numel), one per arena thread. One part runs on the calling thread.
  template <typename Body>
  void ForEachRange(size_t numel, const Body& body) {
    const size_t blocks = (numel + kBlockElements - 1) / kBlockElements;
    const size_t parts = std::min(blocks, static_cast<size_t>(threads));
    if (parts <= 1) {
      if (numel > 0) body(size_t{0}, numel);
      return;
    }
    arena.execute([&] {
      tbb::parallel_for(
          size_t{0}, parts,
          [&](size_t part) {
            const size_t first_block = part * blocks / parts;
            const size_t last_block = (part + 1) * blocks / parts;
            body(first_block * kBlockElements, std::min(last_block * kBlockElements, numel));
          },
          tbb::static_partitioner());
    });
  }

  void Run(int update, const StepBuffers& b, const Coefficients& coefficients) {
    const int grad = static_cast<int>(b.grad_dtype);
    const int state = b.state_dtype == DType::kBf16 ? internal::kStateBf16 : internal::kStateFp32;
    int copy = internal::kCopyNone;
    if (b.param_copy != nullptr) {
      copy = b.param_copy_dtype == DType::kFp16 ? internal::kCopyFp16 : internal::kCopyBf16;
    }
    const internal::StepKernel kernel = kernels->step[update][grad][state][copy];
    auto out = [](void* given, void* in_place) { return given != nullptr ? given : in_place; };
    const KernelArgs args = {b.params,
                             b.grads,
                             b.exp_avg,
                             b.exp_avg_sq,
                             b.param_copy,
                             coefficients,
                             static_cast<float*>(out(b.params_out, b.params)),
                             out(b.exp_avg_out, b.exp_avg),
                             out(b.exp_avg_sq_out, b.exp_avg_sq)};
    ForEachRange(b.numel, [&](size_t begin, size_t end) { kernel(args, begin, end); });
  }

  SimdLevel level;
  const KernelTable* kernels;
  int threads;
  tbb::task_arena arena;
};

Result<CpuOptimizer> CpuOptimizer::Create(const CpuOptimizerOptions& options) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  STRATA_ASSIGN_OR_RETURN(const SimdLevel level, ResolveSimdLevel(options.simd));
  const int threads = options.threads > 0 ? options.threads : tbb::info::default_concurrency();
  return CpuOptimizer(std::make_unique<Impl>(level, threads));
}

CpuOptimizer::CpuOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuOptimizer::CpuOptimizer(CpuOptimizer&& other) noexcept = default;
CpuOptimizer& CpuOptimizer::operator=(CpuOptimizer&& other) noexcept = default;
CpuOptimizer::~CpuOptimizer() = default;

SimdLevel CpuOptimizer::simd_level() const { return impl_->level; }
int CpuOptimizer::threads() const { return impl_->threads; }

Status CpuOptimizer::Step(const AdamWHyperParams& h, const StepBuffers& buffers) {
  STRATA_RETURN_IF_ERROR(ValidateAdam(OptimizerType::kAdamW, h));
  STRATA_RETURN_IF_ERROR(ValidateBuffers(OptimizerType::kAdamW, buffers));
  Coefficients c =
      AdamCoefficients(h.lr, h.beta1, h.beta2, h.eps, h.bias_correction, h.step, h.grad_scale);
  c.param_decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  impl_->Run(internal::kAdamW, buffers, c);
  return Status::Ok();
}

Status CpuOptimizer::Step(const AdamHyperParams& h, const StepBuffers& buffers) {
  STRATA_RETURN_IF_ERROR(ValidateAdam(OptimizerType::kAdam, h));
  STRATA_RETURN_IF_ERROR(ValidateBuffers(OptimizerType::kAdam, buffers));
  Coefficients c =
      AdamCoefficients(h.lr, h.beta1, h.beta2, h.eps, h.bias_correction, h.step, h.grad_scale);
  c.l2_weight_decay = static_cast<float>(h.weight_decay);
  impl_->Run(internal::kAdam, buffers, c);
  return Status::Ok();
}

Status CpuOptimizer::Step(const AdagradHyperParams& h, const StepBuffers& buffers) {
  const Checker check(OptimizerType::kAdagrad);
  STRATA_RETURN_IF_ERROR(check.NonNegative("lr", h.lr));
  STRATA_RETURN_IF_ERROR(check.NonNegative("lr_decay", h.lr_decay));
  STRATA_RETURN_IF_ERROR(check.NonNegative("weight_decay", h.weight_decay));
  STRATA_RETURN_IF_ERROR(check.NonNegative("eps", h.eps));
  STRATA_RETURN_IF_ERROR(check.PositiveStep(h.step));
  STRATA_RETURN_IF_ERROR(check.Finite("grad_scale", h.grad_scale));
  STRATA_RETURN_IF_ERROR(ValidateBuffers(OptimizerType::kAdagrad, buffers));
  Coefficients c{};
  c.grad_scale = static_cast<float>(h.grad_scale);
  c.l2_weight_decay = static_cast<float>(h.weight_decay);
  c.param_decay = 1.0f;
  c.step_size = static_cast<float>(h.lr / (1.0 + static_cast<double>(h.step - 1) * h.lr_decay));
  c.bias_correction2_sqrt = 1.0f;
  c.inv_bias_correction2_sqrt = 1.0f;
  c.eps = static_cast<float>(h.eps);
  impl_->Run(internal::kAdagrad, buffers, c);
  return Status::Ok();
}

Status CpuOptimizer::Step(const LionHyperParams& h, const StepBuffers& buffers) {
  const Checker check(OptimizerType::kLion);
  STRATA_RETURN_IF_ERROR(check.NonNegative("lr", h.lr));
  STRATA_RETURN_IF_ERROR(check.InRange("beta1", h.beta1, 0.0, 1.0, /*high_inclusive=*/true));
  STRATA_RETURN_IF_ERROR(check.InRange("beta2", h.beta2, 0.0, 1.0, /*high_inclusive=*/true));
  STRATA_RETURN_IF_ERROR(check.NonNegative("weight_decay", h.weight_decay));
  STRATA_RETURN_IF_ERROR(check.Finite("grad_scale", h.grad_scale));
  STRATA_RETURN_IF_ERROR(ValidateBuffers(OptimizerType::kLion, buffers));
  Coefficients c{};
  c.grad_scale = static_cast<float>(h.grad_scale);
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.param_decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.step_size = static_cast<float>(h.lr);
  c.bias_correction2_sqrt = 1.0f;
  c.inv_bias_correction2_sqrt = 1.0f;
  impl_->Run(internal::kLion, buffers, c);
  return Status::Ok();
}

Status CpuOptimizer::RooflineStep(OptimizerType type, const StepBuffers& buffers) {
  STRATA_RETURN_IF_ERROR(ValidateBuffers(type, buffers));
  int update = internal::kRooflineTwoStates;
  if (type == OptimizerType::kAdagrad) update = internal::kRooflineExpAvgSq;
  if (type == OptimizerType::kLion) update = internal::kRooflineExpAvg;
  Coefficients c{};
  c.grad_scale = 1.0f;
  impl_->Run(update, buffers, c);
  return Status::Ok();
}

Result<GradientStats> CpuOptimizer::ComputeGradientStats(const void* grads, DType dtype,
                                                         size_t numel, bool checksum) {
  if (numel == 0) return GradientStats{};
  if (grads == nullptr) {
    return InvalidArgument("gradient stats: grads is null but numel is " + std::to_string(numel));
  }
  if (reinterpret_cast<uintptr_t>(grads) % DTypeSize(dtype) != 0) {
    return InvalidArgument("gradient stats: grads is not aligned to its element size (" +
                           std::to_string(DTypeSize(dtype)) + " bytes)");
  }
  // One partial sum per block, summed in block order: the same additions for any thread count.
  const internal::SumOfSquaresKernel kernel =
      impl_->kernels->sum_of_squares[static_cast<int>(dtype)];
  const size_t blocks = (numel + kBlockElements - 1) / kBlockElements;
  std::vector<double> block_sums(blocks);
  std::vector<XXH64_hash_t> block_hashes(checksum ? blocks : 0);
  const size_t element_bytes = DTypeSize(dtype);
  impl_->ForEachRange(numel, [&](size_t begin, size_t end) {
    for (size_t block_begin = begin; block_begin < end; block_begin += kBlockElements) {
      const size_t block_end = std::min(block_begin + kBlockElements, end);
      const size_t block = block_begin / kBlockElements;
      block_sums[block] = kernel(grads, block_begin, block_end);
      if (checksum) {
        // The block was just read: hashing it now costs cache reads, not another memory pass.
        block_hashes[block] =
            XXH3_64bits(static_cast<const std::byte*>(grads) + block_begin * element_bytes,
                        (block_end - block_begin) * element_bytes);
      }
    }
  });
  GradientStats stats;
  for (double block_sum : block_sums) stats.sum_of_squares += block_sum;
  if (checksum) {
    stats.checksum = XXH3_64bits(block_hashes.data(), block_hashes.size() * sizeof(XXH64_hash_t));
  }
  // A finite fp32 square cannot overflow double, even summed over 2^64 elements, so a
  // non-finite sum means a non-finite element.
  stats.all_finite = std::isfinite(stats.sum_of_squares);
  return stats;
}

Status CpuOptimizer::Fill(void* data, DType dtype, size_t numel, float value) {
  if (numel == 0) return Status::Ok();
  if (data == nullptr) {
    return InvalidArgument("fill: data is null but numel is " + std::to_string(numel));
  }
  if (reinterpret_cast<uintptr_t>(data) % DTypeSize(dtype) != 0) {
    return InvalidArgument("fill: data is not aligned to its element size (" +
                           std::to_string(DTypeSize(dtype)) + " bytes)");
  }
  if (dtype == DType::kFp32) {
    auto* out = static_cast<float*>(data);
    impl_->ForEachRange(
        numel, [&](size_t begin, size_t end) { std::fill(out + begin, out + end, value); });
  } else {
    const uint16_t bits = dtype == DType::kFp16 ? Fp32ToFp16(value) : Fp32ToBf16(value);
    auto* out = static_cast<uint16_t*>(data);
    impl_->ForEachRange(numel,
                        [&](size_t begin, size_t end) { std::fill(out + begin, out + end, bits); });
  }
  return Status::Ok();
}

namespace {

Status CheckQuantizeBuffers(const char* what, const void* values, DType dtype, size_t numel,
                            int bits, const void* quantized) {
  if (!IsQuantBits(bits)) {
    return InvalidArgument(std::string(what) + ": " + std::to_string(bits) +
                           " bits; blockwise quantization writes 8 or 4");
  }
  if (values == nullptr || quantized == nullptr) {
    return InvalidArgument(std::string(what) + ": a buffer is null but numel is " +
                           std::to_string(numel));
  }
  if (reinterpret_cast<uintptr_t>(values) % DTypeSize(dtype) != 0 ||
      reinterpret_cast<uintptr_t>(quantized) % sizeof(float) != 0) {
    return InvalidArgument(std::string(what) +
                           ": values must be aligned to their element size and the quantized "
                           "bytes to 4");
  }
  return Status::Ok();
}

size_t QuantBlocks(size_t numel) { return (numel + kQuantBlockElements - 1) / kQuantBlockElements; }

}  // namespace

static_assert(internal::kQuantBlockElements == kQuantBlockElements);

Status CpuOptimizer::Quantize(const void* in, DType dtype, size_t numel, int bits, std::byte* out) {
  if (numel == 0 && IsQuantBits(bits)) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckQuantizeBuffers("quantize", in, dtype, numel, bits, out));
  const internal::QuantizeKernel kernel = impl_->kernels->quantize[static_cast<int>(dtype)];
  auto* scales = reinterpret_cast<float*>(out);
  auto* values = reinterpret_cast<unsigned char*>(out + QuantBlocks(numel) * sizeof(float));
  // The kernels write (numel * bits + 7) / 8 bytes; the padding to 4 is zeros.
  const size_t written = (numel * size_t(bits) + 7) / 8;
  std::memset(values + written, 0, QuantizedBytes(numel, bits) - QuantBlocks(numel) * 4 - written);
  // Ranges are kBlockElements-aligned, so each holds whole quantization blocks (and whole bytes).
  impl_->ForEachRange(numel, [&](size_t begin, size_t end) {
    kernel(in, numel, begin / kQuantBlockElements, QuantBlocks(end), bits, scales, values);
  });
  return Status::Ok();
}

Status CpuOptimizer::Dequantize(const std::byte* in, int bits, size_t numel, void* out,
                                DType dtype) {
  if (numel == 0 && IsQuantBits(bits)) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckQuantizeBuffers("dequantize", out, dtype, numel, bits, in));
  const internal::DequantizeKernel kernel = impl_->kernels->dequantize[static_cast<int>(dtype)];
  const auto* scales = reinterpret_cast<const float*>(in);
  const auto* values =
      reinterpret_cast<const unsigned char*>(in + QuantBlocks(numel) * sizeof(float));
  impl_->ForEachRange(numel, [&](size_t begin, size_t end) {
    kernel(values, bits, scales, numel, begin / kQuantBlockElements, QuantBlocks(end), out);
  });
  return Status::Ok();
}

void CpuOptimizer::ParallelFor(size_t numel,
                               const std::function<void(size_t begin, size_t end)>& body) {
  impl_->ForEachRange(numel, body);
}

}  // namespace strata::cpu_adam
