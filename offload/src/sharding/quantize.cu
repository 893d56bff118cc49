// ZeRO++'s blockwise quantization on a CUDA stream (cuda_quantize.h). One thread block per
// quantization block, one thread per value: the largest magnitude is a block-wide max (exact in
// any order), and every value is the same single-rounded operations as the CPU kernels, so the
// bytes match cpu_adam's on every instruction set. nvcc keeps IEEE division and does not contract
// a lone multiplication; no fast-math flag may be added to this file.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "sharding/cuda_quantize.h"
#include "strata/cpu_adam/cpu_optimizer.h"

namespace strata::offload::cuda {
namespace {

constexpr int kBlock = int(cpu_adam::kQuantBlockElements);
static_assert(kBlock % 32 == 0 && kBlock <= 1024);
/// Blocks below this magnitude are flushed to zeros (levels / largest must stay finite).
constexpr float kFlushBelow = 0x1p-100f;

template <typename T>
__device__ float Load(const T* in, size_t i);
template <>
__device__ float Load<float>(const float* in, size_t i) {
  return in[i];
}
template <>
__device__ float Load<__half>(const __half* in, size_t i) {
  return __half2float(in[i]);
}
template <>
__device__ float Load<__nv_bfloat16>(const __nv_bfloat16* in, size_t i) {
  return __bfloat162float(in[i]);
}

template <typename T>
__device__ void Store(T* out, size_t i, float x);
template <>
__device__ void Store<float>(float* out, size_t i, float x) {
  out[i] = x;
}
template <>
__device__ void Store<__half>(__half* out, size_t i, float x) {
  out[i] = __float2half_rn(x);
}
template <>
__device__ void Store<__nv_bfloat16>(__nv_bfloat16* out, size_t i, float x) {
  out[i] = __float2bfloat16_rn(x);
}

template <typename T>
__global__ void QuantizeKernel(const T* in, size_t numel, int bits, float* scales,
                               unsigned char* values) {
  __shared__ float warp_max[kBlock / 32];
  __shared__ signed char staged[kBlock];
  const size_t b = blockIdx.x;
  const size_t i = b * kBlock + threadIdx.x;
  const size_t count = numel - b * kBlock < size_t(kBlock) ? numel - b * kBlock : size_t(kBlock);
  const bool mine = threadIdx.x < count;
  const float x = mine ? Load(in, i) : 0.0f;
  const bool finite = __syncthreads_and(!mine || isfinite(x)) != 0;
  float top = fabsf(x);
  for (int offset = 16; offset > 0; offset /= 2) {
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
  }
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = top;
  __syncthreads();
  top = warp_max[0];
  for (int w = 1; w < kBlock / 32; ++w) top = fmaxf(top, warp_max[w]);

  const float levels = bits == 8 ? 127.0f : 7.0f;
  signed char q = 0;
  if (!finite || !(top >= kFlushBelow)) {
    if (threadIdx.x == 0) scales[b] = finite ? 0.0f : __int_as_float(0x7fc00000);
  } else {
    if (threadIdx.x == 0) scales[b] = __fdiv_rn(top, levels);
    const float inverse = __fdiv_rn(levels, top);
    const int rounded = __float2int_rn(__fmul_rn(x, inverse));  // Nearest even.
    q = static_cast<signed char>(min(max(rounded, -128), 127));
  }
  if (bits == 8) {
    if (mine) values[i] = static_cast<unsigned char>(q);
    return;
  }
  staged[threadIdx.x] = mine ? q : 0;
  __syncthreads();
  if (threadIdx.x < (count + 1) / 2) {
    const unsigned low = static_cast<unsigned char>(staged[2 * threadIdx.x]) & 0x0Fu;
    const unsigned high = static_cast<unsigned char>(staged[2 * threadIdx.x + 1]) & 0x0Fu;
    values[b * kBlock / 2 + threadIdx.x] = static_cast<unsigned char>(low | high << 4);
  }
}

template <typename T>
__global__ void DequantizeKernel(const unsigned char* values, int bits, const float* scales,
                                 size_t numel, T* out) {
  const size_t i = size_t(blockIdx.x) * kBlock + threadIdx.x;
  if (i >= numel) return;
  int q;
  if (bits == 8) {
    q = static_cast<signed char>(values[i]);
  } else {
    const unsigned nibble = i % 2 == 0 ? values[i / 2] & 0x0Fu : unsigned{values[i / 2]} >> 4;
    q = nibble >= 8 ? int(nibble) - 16 : int(nibble);
  }
  Store(out, i, __fmul_rn(float(q), scales[blockIdx.x]));
}

Status Check(const char* what, const void* values, DType dtype, int bits, const void* quantized) {
  if (!cpu_adam::IsQuantBits(bits)) {
    return InvalidArgument(std::string(what) + ": " + std::to_string(bits) +
                           " bits; blockwise quantization writes 8 or 4");
  }
  if (values == nullptr || quantized == nullptr ||
      reinterpret_cast<uintptr_t>(values) % DTypeSize(dtype) != 0 ||
      reinterpret_cast<uintptr_t>(quantized) % sizeof(float) != 0) {
    return InvalidArgument(std::string(what) +
                           ": buffers must be non-null, the values aligned to their element "
                           "size and the quantized bytes to 4");
  }
  return Status::Ok();
}

Status Launched(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return Status::Ok();
  return Internal(std::string(what) + ": " + cudaGetErrorString(error));
}

size_t Blocks(size_t numel) { return (numel + kBlock - 1) / kBlock; }

}  // namespace

Status QuantizeAsync(const void* in, DType dtype, size_t numel, int bits, std::byte* out,
                     void* stream) {
  if (numel == 0 && cpu_adam::IsQuantBits(bits)) return Status::Ok();
  STRATA_RETURN_IF_ERROR(Check("quantize on the GPU", in, dtype, bits, out));
  auto* s = static_cast<cudaStream_t>(stream);
  auto* scales = reinterpret_cast<float*>(out);
  auto* values = reinterpret_cast<unsigned char*>(out + Blocks(numel) * sizeof(float));
  // The padding after the values: zeros, as the CPU writes.
  const size_t written = (numel * size_t(bits) + 7) / 8;
  const size_t padding = cpu_adam::QuantizedBytes(numel, bits) - Blocks(numel) * 4 - written;
  if (padding > 0) {
    if (const cudaError_t error = cudaMemsetAsync(values + written, 0, padding, s);
        error != cudaSuccess) {
      return Internal(std::string("zeroing the quantized padding: ") + cudaGetErrorString(error));
    }
  }
  const dim3 grid(unsigned(Blocks(numel)));
  switch (dtype) {
    case DType::kFp32:
      QuantizeKernel<<<grid, kBlock, 0, s>>>(static_cast<const float*>(in), numel, bits, scales,
                                             values);
      break;
    case DType::kFp16:
      QuantizeKernel<<<grid, kBlock, 0, s>>>(static_cast<const __half*>(in), numel, bits, scales,
                                             values);
      break;
    case DType::kBf16:
      QuantizeKernel<<<grid, kBlock, 0, s>>>(static_cast<const __nv_bfloat16*>(in), numel, bits,
                                             scales, values);
      break;
  }
  return Launched("launching the quantize kernel");
}

Status DequantizeAsync(const std::byte* in, int bits, size_t numel, void* out, DType dtype,
                       void* stream) {
  if (numel == 0 && cpu_adam::IsQuantBits(bits)) return Status::Ok();
  STRATA_RETURN_IF_ERROR(Check("dequantize on the GPU", out, dtype, bits, in));
  auto* s = static_cast<cudaStream_t>(stream);
  const auto* scales = reinterpret_cast<const float*>(in);
  const auto* values = reinterpret_cast<const unsigned char*>(in + Blocks(numel) * sizeof(float));
  const dim3 grid(unsigned(Blocks(numel)));
  switch (dtype) {
    case DType::kFp32:
      DequantizeKernel<<<grid, kBlock, 0, s>>>(values, bits, scales, numel,
                                               static_cast<float*>(out));
      break;
    case DType::kFp16:
      DequantizeKernel<<<grid, kBlock, 0, s>>>(values, bits, scales, numel,
                                               static_cast<__half*>(out));
      break;
    case DType::kBf16:
      DequantizeKernel<<<grid, kBlock, 0, s>>>(values, bits, scales, numel,
                                               static_cast<__nv_bfloat16*>(out));
      break;
  }
  return Launched("launching the dequantize kernel");
}

}  // namespace strata::offload::cuda
