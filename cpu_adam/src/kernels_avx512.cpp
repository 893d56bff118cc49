// The optimizer kernels for AVX-512: 16 floats per vector.
//
// Compiled with -mavx512f -mavx2 -mfma -mf16c (set on this file only, in CMakeLists.txt) and
// called only after DetectCpuFeatures() reported all four. Only AVX-512F instructions are used
// (no BW, VL or BF16), so any AVX-512 CPU qualifies. Everything here except the table is in an
// anonymous namespace, so no AVX-512 code can be shared with, or picked by the linker for, other
// translation units.
// GCC 12 warns inside its own AVX-512 headers, whose _mm512_undefined_* helpers initialize a
// variable with itself (GCC bug 105593, fixed in GCC 13). The pragma covers the header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "kernels.h"

namespace strata::cpu_adam::internal {
namespace {

namespace Isa {

using Vec = __m512;
using Half = __m256i;
constexpr size_t kLanes = 16;
constexpr size_t kPairBytes = 64;

Vec Set1(float x) { return _mm512_set1_ps(x); }
Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
Vec Div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
Vec Sqrt(Vec a) { return _mm512_sqrt_ps(a); }
Vec MulAdd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
Vec NegMulAdd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }

Vec Sign(Vec x) {
  const Vec zero = _mm512_setzero_ps();
  const __mmask16 positive = _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ);
  const __mmask16 negative = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
  const Vec ones = _mm512_maskz_mov_ps(positive, _mm512_set1_ps(1.0f));
  return _mm512_mask_mov_ps(ones, negative, _mm512_set1_ps(-1.0f));
}

Vec LoadFp32(const float* p) { return _mm512_loadu_ps(p); }
void StoreFp32(float* p, Vec x) { _mm512_storeu_ps(p, x); }

Vec LoadFp16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

Vec LoadBf16(const uint16_t* p) {
  const __m512i widened =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(widened, 16));
}

Half ToFp16(Vec x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

Half ToBf16(Vec x) {
  // Round to nearest even on the dropped 16 bits; NaNs keep their upper bits and become quiet
  // (strata::Fp32ToBf16 bit for bit, subnormals included, unlike VCVTNEPS2BF16). The 32-bit
  // lanes then hold values below 2^16, which VPMOVDW narrows exactly.
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i upper = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(upper, _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb);
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __m512i quiet_nan = _mm512_or_si512(upper, _mm512_set1_epi32(0x0040));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet_nan));
}

Half TruncateToBf16(Vec x) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
}

void StoreHalf(uint16_t* p, Half h) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h); }
void StreamHalfPair(uint16_t* p, Half low, Half high) {
  const __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(p), line);
}
void StoreFence() { _mm_sfence(); }

// Blockwise int8 quantization.
Vec Abs(Vec x) { return _mm512_abs_ps(x); }
Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
float MaxLanes(Vec x) { return _mm512_reduce_max_ps(x); }
// Rounds to nearest even (the default MXCSR mode) and saturates into kLanes signed bytes.
void StoreInt8(signed char* p, Vec x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(x)));
}
Vec LoadInt8(const signed char* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// Squares are summed in double: each square of an fp32 value is exact there.
struct SquareSums {
  __m512d low, high;
};
SquareSums ZeroSquareSums() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
SquareSums AddSquares(SquareSums sums, Vec x) {
  const __m512d low = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d high =
      _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return {_mm512_fmadd_pd(low, low, sums.low), _mm512_fmadd_pd(high, high, sums.high)};
}
double Total(SquareSums sums) {
  alignas(64) double lanes[16];
  _mm512_store_pd(lanes, sums.low);
  _mm512_store_pd(lanes + 8, sums.high);
  double total = 0.0;
  for (double lane : lanes) total += lane;
  return total;
}

}  // namespace Isa

#include "simd_kernels.inc"

}  // namespace

constexpr KernelTable kAvx512Kernels = MakeKernelTable("avx512");

}  // namespace strata::cpu_adam::internal
