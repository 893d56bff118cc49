// DType: the element types of training state, and conversions between them.
//
// fp16 is IEEE 754 binary16; bf16 is the upper half of an IEEE binary32. Conversions from fp32
// round to nearest, ties to even, and are correct for +-0, subnormals, +-Inf and NaN (a NaN
// stays a NaN of the same sign; it is made quiet). Finite values that round beyond the largest
// finite value become Inf (for fp16: |x| >= 65520). Conversions to fp32 are exact; an fp16
// signalling NaN comes out quiet, while bf16 -> fp32 is exactly a 16-bit shift of the bits.
//
// The scalar functions are branch-free bit manipulation (selects, no data-dependent branches)
// and do not depend on the floating-point environment (rounding mode, flush-to-zero). The bulk
// functions below are loops over inlined copies of them, which GCC vectorizes at -O3 (all four
// with AVX2; Fp32ToFp16 needs AVX2's per-lane shifts).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

enum class DType : int {
  kFp32 = 0,
  kFp16 = 1,
  kBf16 = 2,
};

/// Size of one element in bytes.
constexpr size_t DTypeSize(DType t) { return t == DType::kFp32 ? 4 : 2; }

/// "fp32", "fp16" or "bf16".
std::string_view DTypeName(DType t);

/// Parses "fp32"/"float32"/"float", "fp16"/"float16"/"half", "bf16"/"bfloat16".
Result<DType> ParseDType(std::string_view text);

/// Scalar conversions (bit patterns in uint16_t for the 16-bit types).
uint16_t Fp32ToFp16(float value);
float Fp16ToFp32(uint16_t bits);
uint16_t Fp32ToBf16(float value);
float Bf16ToFp32(uint16_t bits);

/// Bulk conversions; `out.size()` must equal `in.size()`.
void Fp32ToFp16(std::span<const float> in, std::span<uint16_t> out);
void Fp16ToFp32(std::span<const uint16_t> in, std::span<float> out);
void Fp32ToBf16(std::span<const float> in, std::span<uint16_t> out);
void Bf16ToFp32(std::span<const uint16_t> in, std::span<float> out);
/// Rounds `in` to `dtype` (nearest even) into `out`, which holds in.size() elements of it; a
/// plain copy for fp32.
void Fp32ToDType(std::span<const float> in, DType dtype, void* out);
/// Widens out.size() elements of `dtype` at `in` to fp32 (exact); a plain copy for fp32.
void DTypeToFp32(const void* in, DType dtype, std::span<float> out);

}  // namespace strata
