// Test-only stand-in for <immintrin.h>: AVX-512 intrinsics emulated in portable C++ by SIMDe,
// so the AVX-512 kernels' logic (lanes, tails, conversions, masks) is tested on CPUs without
// AVX-512. Found before the compiler's own header because its directory comes first on the
// include path of the emulated test only. SIMDe 0.7.4 lacks a few intrinsics the kernels use;
// they are defined below, with the exact semantics of the instructions (VCVTPS2PH with
// round-to-nearest-even is strata::Fp32ToFp16 bit for bit, and VCVTPH2PS is Fp16ToFp32).
// Emulated FMAs may round twice, so this checks logic, not the last bit of fused arithmetic.
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "strata/core/dtype.h"

#define __mmask16 simde__mmask16
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC

namespace strata_avx512_emulation {

template <typename To, typename From>
To BitCast(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

struct U16x16 {
  uint16_t lane[16];
};
struct U32x16 {
  uint32_t lane[16];
};
struct F32x16 {
  float lane[16];
};
struct F32x8 {
  float lane[8];
};
struct F64x8 {
  double lane[8];
};

}  // namespace strata_avx512_emulation

// VCVTPH2PS zmm, ymm
inline simde__m512 _mm512_cvtph_ps(simde__m256i halves) {
  using namespace strata_avx512_emulation;
  const auto in = BitCast<U16x16>(halves);
  F32x16 out;
  for (int i = 0; i < 16; ++i) out.lane[i] = strata::Fp16ToFp32(in.lane[i]);
  return BitCast<simde__m512>(out);
}

// VCVTPS2PH ymm, zmm, imm (the kernels pass round-to-nearest-even)
inline simde__m256i _mm512_cvtps_ph(simde__m512 floats, int /*rounding*/) {
  using namespace strata_avx512_emulation;
  const auto in = BitCast<F32x16>(floats);
  U16x16 out;
  for (int i = 0; i < 16; ++i) out.lane[i] = strata::Fp32ToFp16(in.lane[i]);
  return BitCast<simde__m256i>(out);
}

// VPMOVZXWD zmm, ymm
inline simde__m512i _mm512_cvtepu16_epi32(simde__m256i values) {
  using namespace strata_avx512_emulation;
  const auto in = BitCast<U16x16>(values);
  U32x16 out;
  for (int i = 0; i < 16; ++i) out.lane[i] = in.lane[i];
  return BitCast<simde__m512i>(out);
}

// VPMOVDW ymm, zmm (truncation)
inline simde__m256i _mm512_cvtepi32_epi16(simde__m512i values) {
  using namespace strata_avx512_emulation;
  const auto in = BitCast<U32x16>(values);
  U16x16 out;
  for (int i = 0; i < 16; ++i) out.lane[i] = static_cast<uint16_t>(in.lane[i]);
  return BitCast<simde__m256i>(out);
}

// VMOVNTDQ m512, zmm (the emulation has no caches to bypass)
inline void _mm512_stream_si512(void* address, simde__m512i value) {
  std::memcpy(address, &value, sizeof(value));
}

// VCVTPS2PD zmm, ymm
inline simde__m512d _mm512_cvtps_pd(simde__m256 floats) {
  using namespace strata_avx512_emulation;
  const auto in = BitCast<F32x8>(floats);
  F64x8 out;
  for (int i = 0; i < 8; ++i) out.lane[i] = in.lane[i];
  return BitCast<simde__m512d>(out);
}

// --- Blockwise int8 quantization ---

// Horizontal maximum (a sequence intrinsic; NaN lanes follow VMAXPS: the second operand wins).
inline float _mm512_reduce_max_ps(simde__m512 floats) {
  using namespace strata_avx512_emulation;
  const auto in = BitCast<F32x16>(floats);
  float top = in.lane[0];
  for (int i = 1; i < 16; ++i) top = top > in.lane[i] ? top : in.lane[i];
  return top;
}

// VCVTPS2DQ zmm, zmm (the default rounding: to nearest even; out of range: 0x80000000)
inline simde__m512i _mm512_cvtps_epi32(simde__m512 floats) {
  using namespace strata_avx512_emulation;
  const auto in = BitCast<F32x16>(floats);
  U32x16 out;
  for (int i = 0; i < 16; ++i) {
    const float r = std::nearbyint(in.lane[i]);
    out.lane[i] = (r >= -2147483648.0f && r < 2147483648.0f)
                      ? static_cast<uint32_t>(static_cast<int32_t>(r))
                      : 0x80000000u;
  }
  return BitCast<simde__m512i>(out);
}

// VPMOVSXBD zmm, xmm
inline simde__m512i _mm512_cvtepi8_epi32(simde__m128i bytes) {
  using namespace strata_avx512_emulation;
  int8_t in[16];
  std::memcpy(in, &bytes, sizeof(in));
  U32x16 out;
  for (int i = 0; i < 16; ++i) out.lane[i] = static_cast<uint32_t>(static_cast<int32_t>(in[i]));
  return BitCast<simde__m512i>(out);
}

// VCVTDQ2PS zmm, zmm (exact for the small integers the kernels convert)
inline simde__m512 _mm512_cvtepi32_ps(simde__m512i words) {
  using namespace strata_avx512_emulation;
  const auto in = BitCast<U32x16>(words);
  F32x16 out;
  for (int i = 0; i < 16; ++i) out.lane[i] = static_cast<float>(static_cast<int32_t>(in.lane[i]));
  return BitCast<simde__m512>(out);
}
