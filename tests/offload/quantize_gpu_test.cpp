// ZeRO++'s quantization kernels on a GPU (label `gpu`): the same bytes as cpu_adam's CPU
// kernels, and the same values back, for every dtype and width, short blocks, NaN and tiny
// blocks — a GPU rank and a CPU rank must read each other's collectives alike.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "sharding/cuda_quantize.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "support/gpu.h"

namespace strata::offload {
namespace {

/// Device memory holding a copy of `bytes`, freed with the object.
class DeviceCopy {
 public:
  explicit DeviceCopy(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&data_, bytes_ + 4), cudaSuccess);
    EXPECT_EQ(cudaMemset(data_, 0xA5, bytes_ + 4), cudaSuccess);  // Not zeros: padding is written.
  }
  ~DeviceCopy() { cudaFree(data_); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  void* data() const { return data_; }
  void Upload(const void* host) {
    EXPECT_EQ(cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<std::byte> Download() const {
    std::vector<std::byte> out(bytes_);
    EXPECT_EQ(cudaMemcpy(out.data(), data_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

/// `numel` values of `dtype`: blocks of different magnitudes, with a NaN block, an infinite
/// one and a tiny one where the size allows.
std::vector<std::byte> Values(DType dtype, size_t numel, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> values(numel);
  for (size_t i = 0; i < numel; ++i) {
    values[i] = normal(rng) * float(1 + (i / cpu_adam::kQuantBlockElements) % 5 * 20);
  }
  const size_t block = cpu_adam::kQuantBlockElements;
  if (numel > 4 * block) {
    values[block + 17] = std::numeric_limits<float>::quiet_NaN();
    values[2 * block + 3] = -std::numeric_limits<float>::infinity();
    for (size_t i = 3 * block; i < 4 * block; ++i) values[i] = 1e-38f;
  }
  std::vector<std::byte> out(numel * DTypeSize(dtype));
  Fp32ToDType(values, dtype, out.data());
  return out;
}

float ValueAt(const std::vector<std::byte>& bytes, DType dtype, size_t i) {
  float value = 0;
  DTypeToFp32(bytes.data() + i * DTypeSize(dtype), dtype, std::span<float>(&value, 1));
  return value;
}

TEST(QuantizeGpuTest, WritesTheCpuKernelsBytesAndReadsThemToTheSameValues) {
  int devices = 0;
  const cudaError_t listed = cudaGetDeviceCount(&devices);
  if (listed != cudaSuccess || devices == 0) {
    STRATA_SKIP_WITHOUT_GPU(std::string("no GPU: ") + cudaGetErrorString(listed));
  }
  auto cpu = cpu_adam::CpuOptimizer::Create({.threads = 1});
  ASSERT_TRUE(cpu.ok());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (const int bits : {8, 4}) {
    for (const DType dtype : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      for (const size_t numel : {size_t{1}, size_t{7}, size_t{256}, size_t{1000},
                                 size_t{5 * 256 + 9}, size_t{3 * 65536 + 5}}) {
        SCOPED_TRACE(std::string(DTypeName(dtype)) + " n=" + std::to_string(numel) +
                     " bits=" + std::to_string(bits));
        const std::vector<std::byte> in = Values(dtype, numel, uint32_t(numel) * 3 + bits);
        const size_t quantized = cpu_adam::QuantizedBytes(numel, bits);
        std::vector<float> words(quantized / 4);
        auto* expected = reinterpret_cast<std::byte*>(words.data());
        ASSERT_TRUE(cpu->Quantize(in.data(), dtype, numel, bits, expected).ok());

        DeviceCopy device_in(in.size()), device_q(quantized), device_out(in.size());
        device_in.Upload(in.data());
        ASSERT_TRUE(cuda::QuantizeAsync(device_in.data(), dtype, numel, bits,
                                        static_cast<std::byte*>(device_q.data()), stream)
                        .ok());
        ASSERT_TRUE(cuda::DequantizeAsync(static_cast<const std::byte*>(device_q.data()), bits,
                                          numel, device_out.data(), dtype, stream)
                        .ok());
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        const std::vector<std::byte> got = device_q.Download();
        ASSERT_EQ(std::memcmp(got.data(), expected, quantized), 0);

        std::vector<std::byte> reference(in.size());
        ASSERT_TRUE(cpu->Dequantize(expected, bits, numel, reference.data(), dtype).ok());
        const std::vector<std::byte> out = device_out.Download();
        for (size_t i = 0; i < numel; ++i) {
          const float a = ValueAt(out, dtype, i), b = ValueAt(reference, dtype, i);
          // NaN payloads may differ between the conversions; NaN-ness may not.
          ASSERT_TRUE(std::isnan(a) ? std::isnan(b) : std::memcmp(&a, &b, sizeof a) == 0)
              << "element " << i << ": " << a << " vs " << b;
        }
      }
    }
  }
  cudaStreamDestroy(stream);
}

TEST(QuantizeGpuTest, OtherWidthsAndMisalignedBuffersAreRefusedBeforeLaunching) {
  alignas(8) std::byte bytes[64] = {};
  float values[8] = {};
  EXPECT_EQ(cuda::QuantizeAsync(values, DType::kFp32, 8, 2, bytes, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::QuantizeAsync(values, DType::kFp32, 8, 8, bytes + 1, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::DequantizeAsync(bytes, 16, 8, values, DType::kFp32, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(cuda::QuantizeAsync(values, DType::kFp32, 0, 4, nullptr, nullptr).ok());
}

}  // namespace
}  // namespace strata::offload
