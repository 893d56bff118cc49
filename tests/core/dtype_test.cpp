// Tests for strata/core/dtype.h.
//
// The conversions are checked against references that do not share code with the
// implementation: GCC's _Float16 (software or F16C conversion, round to nearest even) for fp16,
// and a nearest-neighbour search done in double precision for bf16.

#include "strata/core/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace strata {
namespace {

static_assert(sizeof(_Float16) == 2, "the fp16 reference needs GCC's _Float16 (x86-64, GCC >= 12)");

uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float FloatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

bool IsFp16Nan(uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0; }
bool IsBf16Nan(uint16_t b) { return (b & 0x7F80) == 0x7F80 && (b & 0x007F) != 0; }

// Reference fp32 -> fp16: the compiler's own conversion.
uint16_t ReferenceFp32ToFp16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}

// Reference fp16 -> fp32.
float ReferenceFp16ToFp32(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}

// Reference fp32 -> bf16: picks the nearer of the two bf16 values that bracket |x|, measured in
// double precision (exact for these operands), ties to the even mantissa. The value above the
// largest finite bf16 is taken as 2^128, as IEEE rounding does with an unbounded exponent; picking
// it means overflow to Inf.
uint16_t ReferenceFp32ToBf16(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | 0x7FC0;  // Only NaN-ness and sign are compared.
  if (std::isinf(x)) return sign | 0x7F80;
  const uint32_t magnitude = BitsOf(x) & 0x7FFFFFFF;
  const uint16_t below = static_cast<uint16_t>(magnitude >> 16);  // Truncation.
  const uint16_t above = static_cast<uint16_t>(below + 1);        // One bf16 ulp larger.
  const double abs_x = std::fabs(static_cast<double>(x));
  const double below_value = static_cast<double>(FloatOf(uint32_t{below} << 16));
  const double above_value =
      above == 0x7F80 ? std::ldexp(1.0, 128) : static_cast<double>(FloatOf(uint32_t{above} << 16));
  const double distance_below = abs_x - below_value;
  const double distance_above = above_value - abs_x;
  uint16_t chosen;
  if (distance_below < distance_above) {
    chosen = below;
  } else if (distance_above < distance_below) {
    chosen = above;
  } else {
    chosen = (below & 1) == 0 ? below : above;
  }
  return sign | chosen;
}

// Small, fast generator (SplitMix64) so the sample loops stay cheap in debug builds.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

 private:
  uint64_t state_;
};

// Collects mismatches between a conversion and its reference and reports the first few.
class MismatchLog {
 public:
  explicit MismatchLog(const char* what) : what_(what) {}

  // Compares 16-bit results; NaN results match when both are NaN with the same sign.
  void Check16(uint32_t input_bits, uint16_t got, uint16_t want, bool (*is_nan)(uint16_t)) {
    ++checked_;
    const bool same = is_nan(want) ? is_nan(got) && (got & 0x8000) == (want & 0x8000) : got == want;
    if (same) return;
    Record(input_bits, got, want);
  }

  // Compares fp32 results bitwise; NaN results match when both are NaN with the same sign.
  void Check32(uint32_t input_bits, float got, float want) {
    ++checked_;
    const bool same = std::isnan(want) ? std::isnan(got) && std::signbit(got) == std::signbit(want)
                                       : BitsOf(got) == BitsOf(want);
    if (same) return;
    Record(input_bits, BitsOf(got), BitsOf(want));
  }

  uint64_t checked() const { return checked_; }
  uint64_t mismatches() const { return mismatches_; }
  std::string Report() const {
    return std::string(what_) + ": " + std::to_string(mismatches_) + " of " +
           std::to_string(checked_) + " differ from the reference" + examples_;
  }

 private:
  void Record(uint32_t input_bits, uint32_t got, uint32_t want) {
    if (mismatches_++ < 10) {
      char line[96];
      std::snprintf(line, sizeof line, "\n  input 0x%08x: got 0x%04x, want 0x%04x", input_bits, got,
                    want);
      examples_ += line;
    }
  }

  const char* what_;
  uint64_t checked_ = 0;
  uint64_t mismatches_ = 0;
  std::string examples_;
};

// Inputs for fp32 -> 16-bit conversions that hit the interesting cases: every fp16 value, the
// exact midpoints between neighbouring fp16 values (ties) and their fp32 neighbours, dense runs
// of fp32 patterns around the subnormal/normal boundary, the smallest subnormal and the overflow
// threshold, and for bf16 the tie and near-tie patterns of every bf16 value.
std::vector<uint32_t> TargetedInputs() {
  std::vector<uint32_t> inputs;
  auto add_with_neighbours = [&inputs](uint32_t magnitude) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      inputs.push_back(sign | magnitude);
      inputs.push_back(sign | (magnitude + 1));
      if (magnitude > 0) inputs.push_back(sign | (magnitude - 1));
    }
  };
  // fp16 values and midpoints. For the largest finite fp16 the next value up is 65536.
  for (uint32_t h = 0; h < 0x7C00; ++h) {
    const double value = ReferenceFp16ToFp32(static_cast<uint16_t>(h));
    const double next = h == 0x7BFF ? 65536.0 : ReferenceFp16ToFp32(static_cast<uint16_t>(h + 1));
    add_with_neighbours(BitsOf(static_cast<float>(value)));
    add_with_neighbours(BitsOf(static_cast<float>((value + next) / 2)));  // Exact in fp32.
  }
  // Dense runs of every fp32 pattern around boundaries.
  auto add_run = [&inputs](uint32_t center, uint32_t radius) {
    for (uint32_t m = center - radius; m != center + radius; ++m) {
      inputs.push_back(m);
      inputs.push_back(m | 0x80000000u);
    }
  };
  add_run(0x38800000u, 1u << 15);  // 2^-14: fp16 subnormal/normal boundary.
  add_run(0x33800000u, 1u << 15);  // 2^-24: smallest fp16 subnormal.
  add_run(0x33000000u, 1u << 15);  // 2^-25: half of it, rounds to 0 or the smallest subnormal.
  add_run(0x477FE000u, 1u << 14);  // 65504 (largest finite fp16) up to 65520 and beyond.
  add_run(0x477FF000u, 1u << 12);  // 65520: the first value that rounds to Inf.
  add_run(0x3F800000u, 1u << 14);  // 1.0.
  add_run(0x00010000u, 1u << 16);  // fp32 subnormals: bf16 subnormals and their ties.
  add_run(0x7F7F8000u, 1u << 15);  // Just below FLT_MAX: bf16 overflow to Inf.
  add_run(0x7F800000u, 1u << 8);   // Inf and the NaNs next to it.
  // bf16 ties and near-ties for every bf16 pattern.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    for (uint32_t low : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) {
      inputs.push_back((b << 16) | low);
    }
  }
  return inputs;
}

// 10 million random patterns per conversion (not the 20 million first planned): with 20 million
// the two sample tests took about 5.4 s in an -O0 build, mostly in the software _Float16
// reference; 10 million keep the whole binary under 3 s there.
constexpr uint64_t kRandomSamples = 10'000'000;

TEST(DTypeTest, Fp16ToFp32MatchesCompilerForAllPatterns) {
  MismatchLog log("Fp16ToFp32");
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    log.Check32(h, Fp16ToFp32(bits), ReferenceFp16ToFp32(bits));
  }
  EXPECT_EQ(log.checked(), 65536u);
  EXPECT_EQ(log.mismatches(), 0u) << log.Report();
}

TEST(DTypeTest, Fp16RoundTripsThroughFp32) {
  MismatchLog log("Fp32ToFp16(Fp16ToFp32(h))");
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const uint16_t back = Fp32ToFp16(Fp16ToFp32(bits));
    // A NaN comes back with the same sign and payload, made quiet.
    const uint16_t want = IsFp16Nan(bits) ? static_cast<uint16_t>(bits | 0x0200) : bits;
    log.Check16(h, back, want, [](uint16_t) { return false; });  // Bitwise, NaNs included.
  }
  EXPECT_EQ(log.mismatches(), 0u) << log.Report();
}

TEST(DTypeTest, Bf16ToFp32IsShiftForAllPatterns) {
  MismatchLog log("Bf16ToFp32");
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float got = Bf16ToFp32(static_cast<uint16_t>(b));
    // Exact bits, NaNs included: compare the fp32 patterns as integers.
    log.Check16(b, static_cast<uint16_t>(BitsOf(got) >> 16), static_cast<uint16_t>(b),
                [](uint16_t) { return false; });
    log.Check16(b, static_cast<uint16_t>(BitsOf(got) & 0xFFFF), 0, [](uint16_t) { return false; });
  }
  EXPECT_EQ(log.mismatches(), 0u) << log.Report();
}

TEST(DTypeTest, Bf16RoundTripsThroughFp32) {
  MismatchLog log("Fp32ToBf16(Bf16ToFp32(b))");
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const uint16_t want = IsBf16Nan(bits) ? static_cast<uint16_t>(bits | 0x0040) : bits;
    log.Check16(b, Fp32ToBf16(Bf16ToFp32(bits)), want, [](uint16_t) { return false; });
  }
  EXPECT_EQ(log.mismatches(), 0u) << log.Report();
}

TEST(DTypeTest, Fp32ToFp16MatchesCompilerOnRandomAndTargetedInputs) {
  MismatchLog log("Fp32ToFp16");
  SplitMix64 random(0x5EED'F16);
  for (uint64_t i = 0; i < kRandomSamples / 2; ++i) {
    const uint64_t r = random.Next();
    for (uint32_t bits : {static_cast<uint32_t>(r), static_cast<uint32_t>(r >> 32)}) {
      const float f = FloatOf(bits);
      log.Check16(bits, Fp32ToFp16(f), ReferenceFp32ToFp16(f), IsFp16Nan);
    }
  }
  for (uint32_t bits : TargetedInputs()) {
    const float f = FloatOf(bits);
    log.Check16(bits, Fp32ToFp16(f), ReferenceFp32ToFp16(f), IsFp16Nan);
  }
  EXPECT_EQ(log.mismatches(), 0u) << log.Report();
}

TEST(DTypeTest, Fp32ToBf16MatchesNearestNeighbourOnRandomAndTargetedInputs) {
  MismatchLog log("Fp32ToBf16");
  SplitMix64 random(0x5EED'BF16);
  for (uint64_t i = 0; i < kRandomSamples / 2; ++i) {
    const uint64_t r = random.Next();
    for (uint32_t bits : {static_cast<uint32_t>(r), static_cast<uint32_t>(r >> 32)}) {
      const float f = FloatOf(bits);
      log.Check16(bits, Fp32ToBf16(f), ReferenceFp32ToBf16(f), IsBf16Nan);
    }
  }
  for (uint32_t bits : TargetedInputs()) {
    const float f = FloatOf(bits);
    log.Check16(bits, Fp32ToBf16(f), ReferenceFp32ToBf16(f), IsBf16Nan);
  }
  EXPECT_EQ(log.mismatches(), 0u) << log.Report();
}

TEST(DTypeTest, NansStayQuietNansOfTheSameSign) {
  // Payloads only in the low bits would become Inf if truncated.
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t payload : {0x000001u, 0x001FFFu, 0x00FFFFu, 0x200000u, 0x400000u, 0x7FFFFFu}) {
      const float nan = FloatOf(sign | 0x7F800000u | payload);
      SCOPED_TRACE(testing::Message() << "input 0x" << std::hex << BitsOf(nan));
      const uint16_t half = Fp32ToFp16(nan);
      EXPECT_TRUE(IsFp16Nan(half));
      EXPECT_EQ(half & 0x0200, 0x0200) << "fp16 NaN is not quiet";
      EXPECT_EQ(half & 0x8000, sign >> 16);
      const uint16_t brain = Fp32ToBf16(nan);
      EXPECT_TRUE(IsBf16Nan(brain));
      EXPECT_EQ(brain & 0x0040, 0x0040) << "bf16 NaN is not quiet";
      EXPECT_EQ(brain & 0x8000, sign >> 16);
    }
  }
  const float negative_nan = -std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(Fp16ToFp32(Fp32ToFp16(negative_nan))));
  EXPECT_TRUE(std::signbit(Fp16ToFp32(Fp32ToFp16(negative_nan))));
  EXPECT_TRUE(std::isnan(Bf16ToFp32(Fp32ToBf16(negative_nan))));
  EXPECT_TRUE(std::signbit(Bf16ToFp32(Fp32ToBf16(negative_nan))));
  // A signalling fp16 NaN comes out of Fp16ToFp32 as a quiet fp32 NaN.
  EXPECT_EQ(BitsOf(Fp16ToFp32(0x7C01)), 0x7FC02000u);
  EXPECT_EQ(BitsOf(Fp16ToFp32(0xFC01)), 0xFFC02000u);
}

TEST(DTypeTest, SpecificFp16Values) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(Fp32ToFp16(0.0f), 0x0000);
  EXPECT_EQ(Fp32ToFp16(-0.0f), 0x8000);
  EXPECT_EQ(Fp32ToFp16(inf), 0x7C00);
  EXPECT_EQ(Fp32ToFp16(-inf), 0xFC00);
  EXPECT_EQ(Fp32ToFp16(1.0f), 0x3C00);
  EXPECT_EQ(Fp32ToFp16(-2.0f), 0xC000);
  // Smallest subnormal 2^-24; half of it is a tie that rounds to even (0); just above rounds up.
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(Fp32ToFp16(-std::ldexp(1.0f, -25)), 0x8000);
  EXPECT_EQ(Fp32ToFp16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(Fp32ToFp16(3 * std::ldexp(1.0f, -25)), 0x0002);  // 1.5 ulp: tie to even 2.
  EXPECT_EQ(Fp32ToFp16(5 * std::ldexp(1.0f, -25)), 0x0002);  // 2.5 ulp: tie to even 2.
  EXPECT_EQ(Fp32ToFp16(std::numeric_limits<float>::denorm_min()), 0x0000);
  // Largest subnormal and smallest normal.
  EXPECT_EQ(Fp32ToFp16(1023 * std::ldexp(1.0f, -24)), 0x03FF);
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(Fp32ToFp16(std::nextafter(std::ldexp(1.0f, -14), 0.0f)), 0x0400);
  // Largest finite, and the overflow threshold 65520.
  EXPECT_EQ(Fp32ToFp16(65504.0f), 0x7BFF);
  EXPECT_EQ(Fp32ToFp16(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  EXPECT_EQ(Fp32ToFp16(65520.0f), 0x7C00);
  EXPECT_EQ(Fp32ToFp16(-65520.0f), 0xFC00);
  EXPECT_EQ(Fp32ToFp16(1e10f), 0x7C00);
  EXPECT_EQ(Fp32ToFp16(std::numeric_limits<float>::max()), 0x7C00);

  EXPECT_EQ(BitsOf(Fp16ToFp32(0x0000)), BitsOf(0.0f));
  EXPECT_EQ(BitsOf(Fp16ToFp32(0x8000)), BitsOf(-0.0f));
  EXPECT_EQ(Fp16ToFp32(0x7C00), inf);
  EXPECT_EQ(Fp16ToFp32(0xFC00), -inf);
  EXPECT_EQ(Fp16ToFp32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFp32(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFp32(0x03FF), 1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFp32(0x7BFF), 65504.0f);
  EXPECT_EQ(Fp16ToFp32(0x3555), 0.333251953125f);
}

TEST(DTypeTest, SpecificBf16Values) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(Fp32ToBf16(0.0f), 0x0000);
  EXPECT_EQ(Fp32ToBf16(-0.0f), 0x8000);
  EXPECT_EQ(Fp32ToBf16(inf), 0x7F80);
  EXPECT_EQ(Fp32ToBf16(-inf), 0xFF80);
  EXPECT_EQ(Fp32ToBf16(1.0f), 0x3F80);
  EXPECT_EQ(Fp32ToBf16(FloatOf(0x3F808000u)), 0x3F80);  // Tie, even stays.
  EXPECT_EQ(Fp32ToBf16(FloatOf(0x3F818000u)), 0x3F82);  // Tie, odd rounds up.
  EXPECT_EQ(Fp32ToBf16(FloatOf(0x3F808001u)), 0x3F81);
  // fp32 subnormals keep their upper bits, rounded to nearest even.
  EXPECT_EQ(Fp32ToBf16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(Fp32ToBf16(FloatOf(0x00008000u)), 0x0000);
  EXPECT_EQ(Fp32ToBf16(FloatOf(0x00008001u)), 0x0001);
  EXPECT_EQ(Fp32ToBf16(FloatOf(0x00018000u)), 0x0002);
  EXPECT_EQ(Fp32ToBf16(FloatOf(0x807F0000u)), 0x807F);  // Largest negative subnormal.
  // Largest finite bf16, and overflow to Inf of values that round beyond it.
  EXPECT_EQ(Fp32ToBf16(FloatOf(0x7F7F0000u)), 0x7F7F);
  EXPECT_EQ(Fp32ToBf16(FloatOf(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(Fp32ToBf16(FloatOf(0x7F7F8000u)), 0x7F80);
  EXPECT_EQ(Fp32ToBf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(Fp32ToBf16(-std::numeric_limits<float>::max()), 0xFF80);

  EXPECT_EQ(BitsOf(Bf16ToFp32(0x8000)), 0x80000000u);
  EXPECT_EQ(Bf16ToFp32(0x7F80), inf);
  EXPECT_EQ(Bf16ToFp32(0x0001), FloatOf(0x00010000u));
  EXPECT_EQ(Bf16ToFp32(0x7F7F), FloatOf(0x7F7F0000u));
}

TEST(DTypeTest, BulkConversionsMatchScalar) {
  SplitMix64 random(42);
  std::vector<float> floats(1000 + 3);  // Not a multiple of any vector width.
  for (float& f : floats) f = FloatOf(static_cast<uint32_t>(random.Next()));
  floats[0] = 65520.0f;
  floats[1] = -0.0f;
  std::vector<uint16_t> halves(floats.size());
  std::vector<uint16_t> brains(floats.size());
  Fp32ToFp16(floats, halves);
  Fp32ToBf16(floats, brains);
  for (size_t i = 0; i < floats.size(); ++i) {
    ASSERT_EQ(halves[i], Fp32ToFp16(floats[i])) << "index " << i;
    ASSERT_EQ(brains[i], Fp32ToBf16(floats[i])) << "index " << i;
  }
  std::vector<float> from_halves(floats.size());
  std::vector<float> from_brains(floats.size());
  Fp16ToFp32(halves, from_halves);
  Bf16ToFp32(brains, from_brains);
  for (size_t i = 0; i < floats.size(); ++i) {
    ASSERT_EQ(BitsOf(from_halves[i]), BitsOf(Fp16ToFp32(halves[i]))) << "index " << i;
    ASSERT_EQ(BitsOf(from_brains[i]), BitsOf(Bf16ToFp32(brains[i]))) << "index " << i;
  }
  // Empty spans are fine.
  Fp32ToFp16(std::span<const float>(), std::span<uint16_t>());
}

TEST(DTypeDeathTest, BulkConversionChecksSizesInDebugBuilds) {
  std::vector<float> floats(4);
  std::vector<uint16_t> halves(3);
  EXPECT_DEBUG_DEATH(Fp32ToFp16(floats, halves), "must equal");
}

TEST(DTypeTest, RoundingToADTypeAndWideningBackKeepsRepresentableValues) {
  // 1.5 and -2.25 are exact in every dtype; 1 + 2^-10 in fp16 (10 mantissa bits), not bf16 (7).
  const std::vector<float> values = {1.5f, -2.25f, 1.0f + 1.0f / 1024, 0.0f};
  for (DType dtype : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    std::vector<std::byte> narrow(values.size() * DTypeSize(dtype));
    Fp32ToDType(values, dtype, narrow.data());
    std::vector<float> wide(values.size(), -1.0f);
    DTypeToFp32(narrow.data(), dtype, wide);
    EXPECT_EQ(wide[0], 1.5f) << DTypeName(dtype);
    EXPECT_EQ(wide[1], -2.25f) << DTypeName(dtype);
    EXPECT_EQ(wide[2], dtype == DType::kBf16 ? 1.0f : values[2]) << DTypeName(dtype);
    EXPECT_EQ(wide[3], 0.0f) << DTypeName(dtype);
  }
}

TEST(DTypeTest, NamesAndSizes) {
  EXPECT_EQ(DTypeName(DType::kFp32), "fp32");
  EXPECT_EQ(DTypeName(DType::kFp16), "fp16");
  EXPECT_EQ(DTypeName(DType::kBf16), "bf16");
  EXPECT_EQ(DTypeSize(DType::kFp32), 4u);
  EXPECT_EQ(DTypeSize(DType::kFp16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBf16), 2u);
  for (DType t : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    Result<DType> parsed = ParseDType(DTypeName(t));
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(*parsed, t);
  }
}

TEST(DTypeTest, ParseAcceptsAliasesCaseInsensitively) {
  const struct {
    const char* text;
    DType want;
  } cases[] = {
      {"fp32", DType::kFp32},    {"float32", DType::kFp32},  {"float", DType::kFp32},
      {"FP32", DType::kFp32},    {"Float", DType::kFp32},    {"fp16", DType::kFp16},
      {"float16", DType::kFp16}, {"half", DType::kFp16},     {"HALF", DType::kFp16},
      {"bf16", DType::kBf16},    {"bfloat16", DType::kBf16}, {"BFloat16", DType::kBf16},
  };
  for (const auto& c : cases) {
    Result<DType> parsed = ParseDType(c.text);
    ASSERT_TRUE(parsed.ok()) << c.text << ": " << parsed.status().ToString();
    EXPECT_EQ(*parsed, c.want) << c.text;
  }
}

TEST(DTypeTest, ParseRejectsUnknownNamesAndQuotesThem) {
  for (const char* text : {"fp8", "", "fp 16", "float64", "bf16 ", "int8"}) {
    Result<DType> parsed = ParseDType(text);
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    const std::string message = parsed.status().message();
    EXPECT_NE(message.find("\"" + std::string(text) + "\""), std::string::npos) << message;
    for (const char* accepted : {"fp32", "fp16", "bf16", "float", "half", "bfloat16"}) {
      EXPECT_NE(message.find(accepted), std::string::npos) << message;
    }
  }
}

}  // namespace
}  // namespace strata
