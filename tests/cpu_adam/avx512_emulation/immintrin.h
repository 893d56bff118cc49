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
