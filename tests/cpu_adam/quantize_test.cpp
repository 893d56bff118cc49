// Blockwise int8 quantization (ZeRO++'s quantized weights): the error bound, the format, and
// that every SIMD level writes the same bytes and reads them back to the same bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "strata/cpu_adam/cpu_optimizer.h"
#include "test_arrays.h"

namespace strata::cpu_adam {
namespace {

using testing::GuardedArray;
using testing::SupportedLevels;

constexpr DType kDtypes[] = {DType::kFp32, DType::kFp16, DType::kBf16};
// Whole blocks, a short last block, fewer values than a vector, several threads' ranges.
constexpr size_t kSizes[] = {1, 7, 256, 1000, 3 * kBlockElements + 5};

GuardedArray RandomValues(DType dtype, size_t n, uint32_t seed) {
  GuardedArray values(dtype, n, 1);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (size_t i = 0; i < n; ++i) {
    // Blocks of very different magnitudes, as layers' weights are.
    values.Set(i, normal(rng) * float(1 + (i / kQuantBlockElements) % 5 * 20));
  }
  return values;
}

std::vector<std::byte> Quantize(CpuOptimizer& optimizer, const GuardedArray& in) {
  std::vector<float> words((QuantizedBytes(in.numel()) + 3) / 4);  // 4-byte aligned.
  std::vector<std::byte> out(QuantizedBytes(in.numel()));
  EXPECT_TRUE(optimizer
                  .QuantizeInt8(in.data(), in.dtype(), in.numel(),
                                reinterpret_cast<std::byte*>(words.data()))
                  .ok());
  std::memcpy(out.data(), words.data(), out.size());
  return out;
}

GuardedArray Dequantize(CpuOptimizer& optimizer, const std::vector<std::byte>& in, DType dtype,
                        size_t n) {
  std::vector<float> words(in.size() / 4);
  std::memcpy(words.data(), in.data(), in.size());
  GuardedArray out(dtype, n, 1);
  EXPECT_TRUE(
      optimizer
          .DequantizeInt8(reinterpret_cast<const std::byte*>(words.data()), n, out.data(), dtype)
          .ok());
  EXPECT_TRUE(out.GuardsIntact());
  return out;
}

TEST(QuantizeTest, FormatIsOneScaleABlockThenOneByteAValue) {
  EXPECT_EQ(QuantizedBytes(1), 4u + 4u);
  EXPECT_EQ(QuantizedBytes(256), 4u + 256u);
  EXPECT_EQ(QuantizedBytes(257), 8u + 260u);
  // A little over half of bf16's bytes: what a gather of quantized weights moves.
  EXPECT_LT(double(QuantizedBytes(1 << 20)), 0.51 * double(2 << 20));
}

TEST(QuantizeTest, EachValueIsWithinHalfAStepOfItsBlocksScale) {
  for (SimdLevel level : SupportedLevels()) {
    auto optimizer = CpuOptimizer::Create({.threads = 2, .simd = level});
    ASSERT_TRUE(optimizer.ok());
    for (DType dtype : kDtypes) {
      for (size_t n : kSizes) {
        SCOPED_TRACE(std::string(SimdLevelName(level)) + " " + std::string(DTypeName(dtype)) +
                     " n=" + std::to_string(n));
        const GuardedArray in = RandomValues(dtype, n, uint32_t(n));
        const GuardedArray out = Dequantize(*optimizer, Quantize(*optimizer, in), dtype, n);
        for (size_t block = 0; block * kQuantBlockElements < n; ++block) {
          const size_t begin = block * kQuantBlockElements;
          const size_t end = std::min(n, begin + kQuantBlockElements);
          float largest = 0.0f;
          for (size_t i = begin; i < end; ++i) largest = std::max(largest, std::fabs(in.Get(i)));
          // Half a quantization step, then the rounding of the result to dtype.
          const float ulp = dtype == DType::kBf16   ? 1.0f / 256
                            : dtype == DType::kFp16 ? 1.0f / 2048
                                                    : 1e-7f;
          for (size_t i = begin; i < end; ++i) {
            ASSERT_LE(std::fabs(out.Get(i) - in.Get(i)),
                      largest / 254.0f * 1.0001f + std::fabs(in.Get(i)) * ulp + 1e-30f)
                << "element " << i;
          }
        }
      }
    }
  }
}

TEST(QuantizeTest, EveryLevelWritesTheSameBytesAndReadsThemToTheSameBits) {
  auto scalar = CpuOptimizer::Create({.threads = 1, .simd = SimdLevel::kScalar});
  ASSERT_TRUE(scalar.ok());
  for (SimdLevel level : SupportedLevels()) {
    auto optimizer = CpuOptimizer::Create({.threads = 2, .simd = level});
    ASSERT_TRUE(optimizer.ok());
    for (DType dtype : kDtypes) {
      for (size_t n : kSizes) {
        SCOPED_TRACE(std::string(SimdLevelName(level)) + " " + std::string(DTypeName(dtype)) +
                     " n=" + std::to_string(n));
        const GuardedArray in = RandomValues(dtype, n, uint32_t(n) + 7);
        const std::vector<std::byte> bytes = Quantize(*optimizer, in);
        ASSERT_EQ(bytes, Quantize(*scalar, in));
        const GuardedArray out = Dequantize(*optimizer, bytes, dtype, n);
        const GuardedArray reference = Dequantize(*scalar, bytes, dtype, n);
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(out.Bits(i), reference.Bits(i)) << "element " << i;
      }
    }
  }
}

TEST(QuantizeTest, ABlockOfZerosAndExactMultiplesComeBackExactly) {
  for (SimdLevel level : SupportedLevels()) {
    auto optimizer = CpuOptimizer::Create({.threads = 1, .simd = level});
    ASSERT_TRUE(optimizer.ok());
    const size_t n = 2 * kQuantBlockElements + 3;
    GuardedArray in(DType::kFp32, n, 0);
    for (size_t i = 0; i < n; ++i) {
      // Block 0 zeros; blocks 1 and 2 multiples of 2^-4, each led by the largest, 127 / 16:
      // their scale is 2^-4 and every value an integer multiple of it.
      const bool first_of_block = i % kQuantBlockElements == 0;
      in.Set(i, i < kQuantBlockElements ? 0.0f
                : first_of_block        ? 127.0f / 16.0f
                                        : float(int(i % 255) - 127) / 16.0f);
    }
    const std::vector<std::byte> bytes = Quantize(*optimizer, in);
    float scales[3];
    std::memcpy(scales, bytes.data(), sizeof scales);
    EXPECT_EQ(scales[0], 0.0f);
    const GuardedArray out = Dequantize(*optimizer, bytes, DType::kFp32, n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(out.Get(i), in.Get(i)) << SimdLevelName(level) << " element " << i;
    }
  }
}

// A NaN or an infinity anywhere in a block makes the whole block come back NaN, whichever lane
// it sits in and whatever follows it (VMAXPS alone would drop it): an fp16 overflow summed
// through a quantized reduction still skips the step. A block too small for its inverse scale
// to be finite comes back zeros. Every level writes the same bytes for them.
TEST(QuantizeTest, NonFiniteBlocksComeBackNaNAndTinyBlocksZeros) {
  auto scalar = CpuOptimizer::Create({.threads = 1, .simd = SimdLevel::kScalar});
  ASSERT_TRUE(scalar.ok());
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (SimdLevel level : SupportedLevels()) {
    auto optimizer = CpuOptimizer::Create({.threads = 1, .simd = level});
    ASSERT_TRUE(optimizer.ok());
    for (DType dtype : kDtypes) {
      SCOPED_TRACE(std::string(SimdLevelName(level)) + " " + std::string(DTypeName(dtype)));
      const size_t n = 4 * kQuantBlockElements + 9;
      GuardedArray in(dtype, n, 0);
      for (size_t i = 0; i < n; ++i) in.Set(i, 1.0f + float(i % 7));
      in.Set(3, nan);                        // Block 0: a NaN, then finite lanes.
      in.Set(kQuantBlockElements + 5, inf);  // Block 1: an infinity, then a NaN in its lane.
      in.Set(kQuantBlockElements + 5 + 16, nan);
      in.Set(2 * kQuantBlockElements + 7, -inf);  // Block 2: a negative infinity alone.
      for (size_t i = 3 * kQuantBlockElements; i < 4 * kQuantBlockElements; ++i) {
        in.Set(i, dtype == DType::kFp32 ? 1e-37f : 0.0f);  // Block 3: tiny (or zeros).
      }
      in.Set(n - 1, nan);  // The short last block: a NaN in its tail.
      const std::vector<std::byte> bytes = Quantize(*optimizer, in);
      ASSERT_EQ(bytes, Quantize(*scalar, in));
      const GuardedArray out = Dequantize(*optimizer, bytes, dtype, n);
      for (size_t i = 0; i < n; ++i) {
        const size_t block = i / kQuantBlockElements;
        if (block == 3) {
          ASSERT_EQ(out.Get(i), 0.0f) << "element " << i;
        } else {
          ASSERT_TRUE(std::isnan(out.Get(i))) << "element " << i << " is " << out.Get(i);
        }
      }
    }
  }
}

TEST(QuantizeTest, NullOrMisalignedBuffersAreRefused) {
  auto optimizer = CpuOptimizer::Create({.threads = 1});
  ASSERT_TRUE(optimizer.ok());
  alignas(8) std::byte bytes[64] = {};
  float values[8] = {};
  EXPECT_EQ(optimizer->QuantizeInt8(nullptr, DType::kFp32, 8, bytes).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(optimizer->QuantizeInt8(values, DType::kFp32, 8, bytes + 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(optimizer->DequantizeInt8(bytes + 2, 8, values, DType::kFp32).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(optimizer->QuantizeInt8(values, DType::kFp32, 0, nullptr).ok());
}

}  // namespace
}  // namespace strata::cpu_adam
