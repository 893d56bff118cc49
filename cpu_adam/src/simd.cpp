#include "strata/cpu_adam/simd.h"

#include <cstdlib>
#include <string>

namespace strata::cpu_adam {
namespace {

std::string Lowercase(std::string_view text) {
  std::string out(text);
  for (char& ch : out) {
    if (ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch - 'A' + 'a');
  }
  return out;
}

// The instructions `level` needs that `f` lacks, e.g. "AVX-512F FMA"; empty when none.
std::string MissingFeatures(SimdLevel level, const CpuFeatures& f) {
  std::string missing;
  auto require = [&missing](bool present, const char* name) {
    if (present) return;
    if (!missing.empty()) missing += ' ';
    missing += name;
  };
  if (level == SimdLevel::kAvx512) require(f.avx512f, "AVX-512F");
  if (level == SimdLevel::kAvx2 || level == SimdLevel::kAvx512) {
    require(f.avx2, "AVX2");
    require(f.fma, "FMA");
    require(f.f16c, "F16C");
  }
  return missing;
}

}  // namespace

std::string_view SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar: return "scalar";
    case SimdLevel::kAvx2: return "avx2";
    case SimdLevel::kAvx512: return "avx512";
  }
  return "unknown";
}

Result<SimdLevel> ParseSimdLevel(std::string_view text) {
  const std::string name = Lowercase(text);
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (name == SimdLevelName(level)) return level;
  }
  return InvalidArgument("unknown SIMD level \"" + std::string(text) +
                         "\": expected scalar, avx2 or avx512");
}

bool SimdLevelSupported(SimdLevel level, const CpuFeatures& features) {
  return MissingFeatures(level, features).empty();
}

SimdLevel BestSupportedSimdLevel() {
  const CpuFeatures& features = DetectCpuFeatures();
  for (SimdLevel level : {SimdLevel::kAvx512, SimdLevel::kAvx2}) {
    if (SimdLevelSupported(level, features)) return level;
  }
  return SimdLevel::kScalar;
}

Result<SimdLevel> ResolveSimdLevel(std::optional<SimdLevel> requested) {
  SimdLevel level = BestSupportedSimdLevel();
  std::string source = "requested";
  if (requested.has_value()) {
    level = *requested;
  } else if (const char* env = std::getenv(std::string(kSimdEnvironmentVariable).c_str());
             env != nullptr && *env != '\0' && Lowercase(env) != "auto") {
    auto parsed = ParseSimdLevel(env);
    if (!parsed.ok()) {
      return parsed.status().WithContext(std::string(kSimdEnvironmentVariable) + "=" + env);
    }
    level = *parsed;
    source = std::string(kSimdEnvironmentVariable) + "=" + env;
  }
  const std::string missing = MissingFeatures(level, DetectCpuFeatures());
  if (!missing.empty()) {
    return Unavailable("SIMD level " + std::string(SimdLevelName(level)) + " (" + source +
                       ") needs " + missing + ", which this CPU lacks; choose " +
                       std::string(SimdLevelName(BestSupportedSimdLevel())) +
                       " or let Strata choose");
  }
  return level;
}

}  // namespace strata::cpu_adam
