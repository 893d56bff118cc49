// The optimizer kernels for AVX2 + FMA + F16C: 8 floats per vector.
//
// Compiled with -mavx2 -mfma -mf16c (set on this file only, in CMakeLists.txt) and called only
// after DetectCpuFeatures() reported all three. Everything here except the table is in an
// anonymous namespace, so no AVX2 code can be shared with, or picked by the linker for, other
// translation units.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "kernels.h"

namespace strata::cpu_adam::internal {
namespace {

namespace Isa {

using Vec = __m256;
using Half = __m128i;
constexpr size_t kLanes = 8;
constexpr size_t kPairBytes = 32;

Vec Set1(float x) { return _mm256_set1_ps(x); }
Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
Vec Div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
Vec Sqrt(Vec a) { return _mm256_sqrt_ps(a); }
Vec MulAdd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
Vec NegMulAdd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }

Vec Sign(Vec x) {
  const Vec zero = _mm256_setzero_ps();
  const Vec one = _mm256_set1_ps(1.0f);
  const Vec positive = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), one);
  const Vec negative = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), one);
  return _mm256_sub_ps(positive, negative);
}

Vec LoadFp32(const float* p) { return _mm256_loadu_ps(p); }
void StoreFp32(float* p, Vec x) { _mm256_storeu_ps(p, x); }

Vec LoadFp16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

Vec LoadBf16(const uint16_t* p) {
  const __m256i widened =
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(widened, 16));
}

// Packs eight 32-bit lanes that hold values below 2^16 into eight 16-bit values, in order.
Half Narrow(__m256i x) {
  // packus works within 128-bit halves: [x0..x3 x0..x3 | x4..x7 x4..x7]; keep qwords 0 and 2.
  const __m256i packed = _mm256_packus_epi32(x, x);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0b1000));
}

Half ToFp16(Vec x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

Half ToBf16(Vec x) {
  // Round to nearest even on the dropped 16 bits; NaNs keep their upper bits and become quiet
  // (strata::Fp32ToBf16 bit for bit, subnormals included, unlike VCVTNEPS2BF16).
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i upper = _mm256_srli_epi32(bits, 16);
  const __m256i lsb = _mm256_and_si256(upper, _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb);
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i quiet_nan = _mm256_or_si256(upper, _mm256_set1_epi32(0x0040));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return Narrow(_mm256_blendv_epi8(rounded, quiet_nan, is_nan));
}

Half TruncateToBf16(Vec x) { return Narrow(_mm256_srli_epi32(_mm256_castps_si256(x), 16)); }

void StoreHalf(uint16_t* p, Half h) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h); }
void StreamHalfPair(uint16_t* p, Half low, Half high) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm256_set_m128i(high, low));
}
void StoreFence() { _mm_sfence(); }

// Blockwise int8 quantization.
Vec Abs(Vec x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
float MaxLanes(Vec x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
// Rounds to nearest even (the default MXCSR mode) and saturates into kLanes signed bytes.
void StoreInt8(signed char* p, Vec x) {
  const __m256i words = _mm256_cvtps_epi32(x);
  const __m128i shorts =
      _mm_packs_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(shorts, shorts));
}
Vec LoadInt8(const signed char* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// Squares are summed in double: each square of an fp32 value is exact there.
struct SquareSums {
  __m256d low, high;
};
SquareSums ZeroSquareSums() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
SquareSums AddSquares(SquareSums sums, Vec x) {
  const __m256d low = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d high = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  return {_mm256_fmadd_pd(low, low, sums.low), _mm256_fmadd_pd(high, high, sums.high)};
}
double Total(SquareSums sums) {
  alignas(32) double lanes[8];
  _mm256_store_pd(lanes, sums.low);
  _mm256_store_pd(lanes + 4, sums.high);
  double total = 0.0;
  for (double lane : lanes) total += lane;
  return total;
}

}  // namespace Isa

#include "simd_kernels.inc"

}  // namespace

constexpr KernelTable kAvx2Kernels = MakeKernelTable("avx2");

}  // namespace strata::cpu_adam::internal
