// ZeRO++'s blockwise quantization on a CUDA stream, for collectives whose buffers live in GPU
// memory (the NCCL path): the byte format of cpu_adam::CpuOptimizer::Quantize, bit for bit, so
// a GPU rank and a CPU rank read each other's bytes back to the same values.
//
// The format (cpu_adam/cpu_optimizer.h): blocks of cpu_adam::kQuantBlockElements values share
// one fp32 scale (the largest magnitude / 127 for 8 bits, / 7 for 4); the scales come first,
// then the values, one signed byte each or two a byte (value 2k in the low nibble of byte k),
// padded with zeros to cpu_adam::QuantizedBytes(numel, bits). A block holding a NaN or an
// infinity gets a NaN scale and values 0; one below 2^-100 in magnitude scale 0 and values 0.
//
// Built only with CUDA (STRATA_CUDA_ENABLED); the engine's stage-3 shards live in host memory
// today and are quantized by the CPU kernels, so these wait for shards on the device.
#pragma once

#include <cstddef>

#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata::offload::cuda {

/// Queues the quantization of `numel` values of `dtype` at device address `in` into
/// cpu_adam::QuantizedBytes(numel, bits) bytes at device address `out` (4-byte aligned) on
/// `stream` (a cudaStream_t). InvalidArgument for bits other than 8 and 4 or a misaligned
/// buffer; Internal when the launch fails.
Status QuantizeAsync(const void* in, DType dtype, size_t numel, int bits, std::byte* out,
                     void* stream);

/// The inverse: `numel` values of `dtype` at device address `out`, each value * its scale in one
/// fp32 multiplication rounded to `dtype` (nearest even).
Status DequantizeAsync(const std::byte* in, int bits, size_t numel, void* out, DType dtype,
                       void* stream);

}  // namespace strata::offload::cuda
