// Blockwise int8 and int4 quantization (ZeRO++'s quantized weights and gradients): the error
// bound, the format, and that every SIMD level writes the same bytes and reads them back to the
// same bits.
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
constexpr int kWidths[] = {8, 4};

// The largest quantized magnitude at `bits`.
float Levels(int bits) { return bits == 8 ? 127.0f : 7.0f; }

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

std::vector<std::byte> Quantize(CpuOptimizer& optimizer, const GuardedArray& in, int bits) {
  const size_t bytes = QuantizedBytes(in.numel(), bits);
  std::vector<float> words((bytes + 3) / 4);  // 4-byte aligned.
  std::vector<std::byte> out(bytes);
  EXPECT_TRUE(optimizer
                  .Quantize(in.data(), in.dtype(), in.numel(), bits,
                            reinterpret_cast<std::byte*>(words.data()))
                  .ok());
  std::memcpy(out.data(), words.data(), out.size());
  return out;
}

GuardedArray Dequantize(CpuOptimizer& optimizer, const std::vector<std::byte>& in, int bits,
                        DType dtype, size_t n) {
  std::vector<float> words(in.size() / 4);
  std::memcpy(words.data(), in.data(), in.size());
  GuardedArray out(dtype, n, 1);
  EXPECT_TRUE(
      optimizer
          .Dequantize(reinterpret_cast<const std::byte*>(words.data()), bits, n, out.data(), dtype)
          .ok());
  EXPECT_TRUE(out.GuardsIntact());
  return out;
}

TEST(QuantizeTest, FormatIsOneScaleABlockThenTheValuesOneOrTwoAByte) {
  EXPECT_EQ(QuantizedBytes(1, 8), 4u + 4u);
  EXPECT_EQ(QuantizedBytes(256, 8), 4u + 256u);
  EXPECT_EQ(QuantizedBytes(257, 8), 8u + 260u);
  EXPECT_EQ(QuantizedBytes(1, 4), 4u + 4u);
  EXPECT_EQ(QuantizedBytes(256, 4), 4u + 128u);
  EXPECT_EQ(QuantizedBytes(257, 4), 8u + 132u);
  EXPECT_EQ(QuantizedBytes(9, 4), 4u + 8u);
  // A little over half of bf16's bytes: what a gather of quantized weights moves; int4
  // gradients a little over an eighth of fp32's.
  EXPECT_LT(double(QuantizedBytes(1 << 20, 8)), 0.51 * double(2 << 20));
  EXPECT_LT(double(QuantizedBytes(1 << 20, 4)), 0.13 * double(4 << 20));
}

// Int4: value 2k in the low nibble of byte k, value 2k + 1 in the high one, two's complement;
// what another implementation (the CUDA kernels, another language) must read.
TEST(QuantizeTest, Int4PacksTwoValuesAByteLowNibbleFirst) {
  for (SimdLevel level : SupportedLevels()) {
    auto optimizer = CpuOptimizer::Create({.threads = 1, .simd = level});
    ASSERT_TRUE(optimizer.ok());
    // Largest 7 (scale exactly 1), then -7 .. 7 in order; an odd count.
    GuardedArray in(DType::kFp32, 16 + 3, 0);
    in.Set(0, 7.0f);
    for (size_t i = 1; i < in.numel(); ++i) in.Set(i, float(int(i % 15) - 7));
    const std::vector<std::byte> bytes = Quantize(*optimizer, in, 4);
    float scale = 0;
    std::memcpy(&scale, bytes.data(), sizeof scale);
    EXPECT_EQ(scale, 1.0f) << SimdLevelName(level);
    for (size_t i = 0; i < in.numel(); ++i) {
      const auto byte = std::to_integer<unsigned>(bytes[4 + i / 2]);
      const unsigned nibble = i % 2 == 0 ? byte & 0xFu : byte >> 4;
      const int value = nibble >= 8 ? int(nibble) - 16 : int(nibble);
      ASSERT_EQ(value, int(in.Get(i))) << SimdLevelName(level) << " element " << i;
    }
    // The odd count's last high nibble and the padding to 4 bytes are zeros.
    EXPECT_EQ(std::to_integer<unsigned>(bytes[4 + in.numel() / 2]) >> 4, 0u);
    for (size_t i = 4 + (in.numel() + 1) / 2; i < bytes.size(); ++i) {
      ASSERT_EQ(bytes[i], std::byte{0}) << "padding byte " << i;
    }
  }
}

TEST(QuantizeTest, EachValueIsWithinHalfAStepOfItsBlocksScale) {
  for (SimdLevel level : SupportedLevels()) {
    auto optimizer = CpuOptimizer::Create({.threads = 2, .simd = level});
    ASSERT_TRUE(optimizer.ok());
    for (int bits : kWidths) {
      for (DType dtype : kDtypes) {
        for (size_t n : kSizes) {
          SCOPED_TRACE(std::string(SimdLevelName(level)) + " " + std::string(DTypeName(dtype)) +
                       " n=" + std::to_string(n) + " bits=" + std::to_string(bits));
          const GuardedArray in = RandomValues(dtype, n, uint32_t(n));
          const GuardedArray out =
              Dequantize(*optimizer, Quantize(*optimizer, in, bits), bits, dtype, n);
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
              ASSERT_LE(std::fabs(out.Get(i) - in.Get(i)), largest / (2 * Levels(bits)) * 1.0001f +
                                                               std::fabs(in.Get(i)) * ulp + 1e-30f)
                  << "element " << i;
            }
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
    for (int bits : kWidths) {
      for (DType dtype : kDtypes) {
        for (size_t n : kSizes) {
          SCOPED_TRACE(std::string(SimdLevelName(level)) + " " + std::string(DTypeName(dtype)) +
                       " n=" + std::to_string(n) + " bits=" + std::to_string(bits));
          const GuardedArray in = RandomValues(dtype, n, uint32_t(n) + 7);
          const std::vector<std::byte> bytes = Quantize(*optimizer, in, bits);
          ASSERT_EQ(bytes, Quantize(*scalar, in, bits));
          const GuardedArray out = Dequantize(*optimizer, bytes, bits, dtype, n);
          const GuardedArray reference = Dequantize(*scalar, bytes, bits, dtype, n);
          for (size_t i = 0; i < n; ++i) {
            ASSERT_EQ(out.Bits(i), reference.Bits(i)) << "element " << i;
          }
        }
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
    const std::vector<std::byte> bytes = Quantize(*optimizer, in, 8);
    float scales[3];
    std::memcpy(scales, bytes.data(), sizeof scales);
    EXPECT_EQ(scales[0], 0.0f);
    const GuardedArray out = Dequantize(*optimizer, bytes, 8, DType::kFp32, n);
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
    for (int bits : kWidths) {
      for (DType dtype : kDtypes) {
        SCOPED_TRACE(std::string(SimdLevelName(level)) + " " + std::string(DTypeName(dtype)) +
                     " bits=" + std::to_string(bits));
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
        const std::vector<std::byte> bytes = Quantize(*optimizer, in, bits);
        ASSERT_EQ(bytes, Quantize(*scalar, in, bits));
        const GuardedArray out = Dequantize(*optimizer, bytes, bits, dtype, n);
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
}

TEST(QuantizeTest, NullOrMisalignedBuffersAndOtherWidthsAreRefused) {
  auto optimizer = CpuOptimizer::Create({.threads = 1});
  ASSERT_TRUE(optimizer.ok());
  alignas(8) std::byte bytes[64] = {};
  float values[8] = {};
  EXPECT_EQ(optimizer->Quantize(nullptr, DType::kFp32, 8, 8, bytes).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(optimizer->Quantize(values, DType::kFp32, 8, 4, bytes + 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(optimizer->Dequantize(bytes + 2, 8, 8, values, DType::kFp32).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(optimizer->Quantize(values, DType::kFp32, 8, 2, bytes).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(optimizer->Dequantize(bytes, 16, 8, values, DType::kFp32).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(optimizer->Quantize(values, DType::kFp32, 0, 3, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(optimizer->Quantize(values, DType::kFp32, 0, 4, nullptr).ok());
}

}  // namespace
}  // namespace strata::cpu_adam
