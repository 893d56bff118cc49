// SimdLevel: which build of the optimizer kernels runs, chosen at run time.
//
// Every kernel exists in three builds, one translation unit each: a scalar reference, AVX2
// (with FMA and F16C) and AVX-512 (AVX-512F with AVX2, FMA and F16C). One binary holds all three
// and runs on any x86-64 CPU; the best level the CPU supports is used unless one is requested.
#pragma once

#include <optional>
#include <string_view>

#include "strata/core/cpu_features.h"
#include "strata/core/status.h"

namespace strata::cpu_adam {

enum class SimdLevel : int {
  kScalar = 0,  ///< Plain C++, one element at a time: the reference. Runs everywhere.
  kAvx2 = 1,    ///< 8 floats per vector. Needs AVX2, FMA and F16C.
  kAvx512 = 2,  ///< 16 floats per vector. Needs AVX-512F, AVX2, FMA and F16C.
};

/// The environment variable that forces a level when none is requested in code:
/// STRATA_SIMD=scalar|avx2|avx512 (or auto, or unset, for the best supported level).
inline constexpr std::string_view kSimdEnvironmentVariable = "STRATA_SIMD";

/// "scalar", "avx2" or "avx512".
std::string_view SimdLevelName(SimdLevel level);

/// Parses "scalar", "avx2" or "avx512" (case-insensitive). "auto" is not a level: callers that
/// accept it map it to std::nullopt themselves.
Result<SimdLevel> ParseSimdLevel(std::string_view text);

/// Whether a CPU with `features` can run `level`.
bool SimdLevelSupported(SimdLevel level, const CpuFeatures& features);

/// The widest level this CPU supports (DetectCpuFeatures()).
SimdLevel BestSupportedSimdLevel();

/// Chooses the level to run, in this order: `requested` when given; else the STRATA_SIMD
/// environment variable when set to a level (this is the only place Strata reads it); else
/// BestSupportedSimdLevel(). Errors: InvalidArgument for an unknown STRATA_SIMD value;
/// Unavailable when the chosen level needs instructions this CPU lacks (the message names them).
Result<SimdLevel> ResolveSimdLevel(std::optional<SimdLevel> requested);

}  // namespace strata::cpu_adam
