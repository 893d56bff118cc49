#include "strata/core/dtype.h"

#include <bit>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <string>

namespace strata {
namespace {

// The scalar conversions compute every candidate result and choose with selects, so that a
// loop over them has no data-dependent branches and the compiler can vectorize it. They use
// integer arithmetic only, so they do not depend on the rounding mode or on flush-to-zero /
// denormals-are-zero settings. Candidates for inputs that take another path may wrap around;
// unsigned arithmetic makes that harmless.

inline uint16_t Fp32ToFp16Bits(float value) {
  const auto x = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7FFFFFFFu;

  // |x| >= 2^-14: fp16 normal. Rebias the exponent (127 -> 15) in place, then shift out 13
  // mantissa bits rounding to nearest even. A carry out of the mantissa correctly bumps the
  // exponent, up to 0x7C00 (Inf) for 65520 <= |x| < 65536.
  const uint32_t rebiased = abs - 0x38000000u;
  const uint32_t normal = (rebiased + 0x0FFFu + ((rebiased >> 13) & 1u)) >> 13;

  // |x| < 2^-14: fp16 subnormal, a multiple of 2^-24. With m the 24-bit significand and e the
  // biased exponent, |x| = m * 2^(e - 150), so the result is m / 2^(126 - e) rounded to nearest
  // even. The shift is at least 14 here and past 25 the result is 0, so any shift outside
  // [14, 31] (including the values for inputs that take another path) is replaced by 31: no UB,
  // and m + 2^30 still fits in 32 bits. fp32 subnormals (e = 0) land in that case and give 0.
  const uint32_t exponent = abs >> 23;
  const uint32_t significand = (abs & 0x007FFFFFu) | 0x00800000u;
  const uint32_t unclamped_shift = 126u - exponent;  // Wraps for exponents above 126.
  const uint32_t shift = (unclamped_shift - 14u) > 17u ? 31u : unclamped_shift;
  const uint32_t subnormal =
      (significand + ((1u << (shift - 1)) - 1u) + ((significand >> shift) & 1u)) >> shift;

  // NaN: keep the upper payload bits and set the quiet bit.
  const uint32_t nan = 0x7E00u | ((abs >> 13) & 0x03FFu);

  uint32_t result = abs < 0x38800000u ? subnormal : normal;
  result = abs >= 0x477FF000u ? 0x7C00u : result;  // >= 65520 (and Inf) rounds to Inf.
  result = abs > 0x7F800000u ? nan : result;
  return static_cast<uint16_t>(sign | result);
}

inline float Fp16ToFp32Bits(uint16_t bits) {
  const uint32_t h = bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x03FFu;
  const uint32_t shifted = (h & 0x7FFFu) << 13;  // Exponent and mantissa in fp32 position.

  // Normal: rebias the exponent (15 -> 127).
  const uint32_t normal = shifted + 0x38000000u;
  // Inf/NaN: exponent all ones; NaNs keep their payload and are made quiet.
  const uint32_t inf_nan = (shifted + 0x70000000u) | (mantissa != 0 ? 0x00400000u : 0u);
  // Zero/subnormal: mantissa * 2^-24, an fp32 normal. Normalize the 10-bit mantissa with selects
  // (shift left until bit 9 is set, counting the shift) rather than with float arithmetic: GCC
  // does not if-convert floating-point operations under the default -ftrapping-math, which would
  // leave a branch in the loop and stop it vectorizing.
  uint32_t normalized = mantissa;
  uint32_t shift = 0;
  shift += normalized < (1u << 2) ? 8u : 0u;
  normalized = normalized < (1u << 2) ? normalized << 8 : normalized;
  shift += normalized < (1u << 6) ? 4u : 0u;
  normalized = normalized < (1u << 6) ? normalized << 4 : normalized;
  shift += normalized < (1u << 8) ? 2u : 0u;
  normalized = normalized < (1u << 8) ? normalized << 2 : normalized;
  shift += normalized < (1u << 9) ? 1u : 0u;
  normalized = normalized < (1u << 9) ? normalized << 1 : normalized;
  // Top bit at 9 - shift, so the value is 2^(9 - shift - 24) * 1.f: biased exponent 112 - shift.
  // normalized << 14 puts the leading 1 at bit 23, which adds one to the exponent field.
  const uint32_t subnormal = mantissa == 0 ? 0u : ((111u - shift) << 23) + (normalized << 14);

  uint32_t result = exponent == 0 ? subnormal : normal;
  result = exponent == 0x1Fu ? inf_nan : result;
  return std::bit_cast<float>(sign | result);
}

inline uint16_t Fp32ToBf16Bits(float value) {
  const auto x = std::bit_cast<uint32_t>(value);
  // Round to nearest even on the 16 bits dropped. Finite values that round past the largest
  // bf16 carry into the exponent and become Inf; Inf stays Inf. The sum cannot wrap: the
  // largest non-NaN pattern is 0xFF800000 (-Inf).
  const uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  // NaN: truncating could clear all payload bits and make it Inf, so set the quiet bit.
  const uint32_t nan = (x >> 16) | 0x0040u;
  return static_cast<uint16_t>((x & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

inline float Bf16ToFp32Bits(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const char ca = (a[i] >= 'A' && a[i] <= 'Z') ? static_cast<char>(a[i] - 'A' + 'a') : a[i];
    if (ca != b[i]) return false;
  }
  return true;
}

}  // namespace

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFp32: return "fp32";
    case DType::kFp16: return "fp16";
    case DType::kBf16: return "bf16";
  }
  return "unknown";
}

Result<DType> ParseDType(std::string_view text) {
  struct Alias {
    std::string_view name;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"fp32", DType::kFp32}, {"float32", DType::kFp32},  {"float", DType::kFp32},
      {"fp16", DType::kFp16}, {"float16", DType::kFp16},  {"half", DType::kFp16},
      {"bf16", DType::kBf16}, {"bfloat16", DType::kBf16},
  };
  for (const Alias& alias : kAliases) {
    if (EqualsIgnoreCase(text, alias.name)) return alias.dtype;
  }
  std::string message = "unknown dtype \"";
  message += text;
  message += "\": expected fp32 (or float32, float), fp16 (or float16, half) or bf16 (or bfloat16)";
  return InvalidArgument(std::move(message));
}

uint16_t Fp32ToFp16(float value) { return Fp32ToFp16Bits(value); }
float Fp16ToFp32(uint16_t bits) { return Fp16ToFp32Bits(bits); }
uint16_t Fp32ToBf16(float value) { return Fp32ToBf16Bits(value); }
float Bf16ToFp32(uint16_t bits) { return Bf16ToFp32Bits(bits); }

void Fp32ToFp16(std::span<const float> in, std::span<uint16_t> out) {
  assert(in.size() == out.size() && "Fp32ToFp16: out.size() must equal in.size()");
  const size_t n = in.size() < out.size() ? in.size() : out.size();
  for (size_t i = 0; i < n; ++i) out[i] = Fp32ToFp16Bits(in[i]);
}

void Fp16ToFp32(std::span<const uint16_t> in, std::span<float> out) {
  assert(in.size() == out.size() && "Fp16ToFp32: out.size() must equal in.size()");
  const size_t n = in.size() < out.size() ? in.size() : out.size();
  for (size_t i = 0; i < n; ++i) out[i] = Fp16ToFp32Bits(in[i]);
}

void Fp32ToBf16(std::span<const float> in, std::span<uint16_t> out) {
  assert(in.size() == out.size() && "Fp32ToBf16: out.size() must equal in.size()");
  const size_t n = in.size() < out.size() ? in.size() : out.size();
  for (size_t i = 0; i < n; ++i) out[i] = Fp32ToBf16Bits(in[i]);
}

void Bf16ToFp32(std::span<const uint16_t> in, std::span<float> out) {
  assert(in.size() == out.size() && "Bf16ToFp32: out.size() must equal in.size()");
  const size_t n = in.size() < out.size() ? in.size() : out.size();
  for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFp32Bits(in[i]);
}

void Fp32ToDType(std::span<const float> in, DType dtype, void* out) {
  switch (dtype) {
    case DType::kFp32: std::memcpy(out, in.data(), in.size_bytes()); break;
    case DType::kFp16: Fp32ToFp16(in, {static_cast<uint16_t*>(out), in.size()}); break;
    case DType::kBf16: Fp32ToBf16(in, {static_cast<uint16_t*>(out), in.size()}); break;
  }
}

void DTypeToFp32(const void* in, DType dtype, std::span<float> out) {
  const auto* half = static_cast<const uint16_t*>(in);
  switch (dtype) {
    case DType::kFp32: std::memcpy(out.data(), in, out.size_bytes()); break;
    case DType::kFp16: Fp16ToFp32({half, out.size()}, out); break;
    case DType::kBf16: Bf16ToFp32({half, out.size()}, out); break;
  }
}

}  // namespace strata
