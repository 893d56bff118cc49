// Test seam for cpu_adam_avx512_emulated_tests: DetectCpuFeatures() reports AVX-512F in addition
// to what the CPU has, so the driver selects the SIMDe-emulated AVX-512 kernels linked into that
// binary. These definitions are linked before libstrata_core.a, whose cpu_features.o (defining
// the same two functions) is then never extracted.
#include "strata/core/cpu_features.h"

namespace strata {

const CpuFeatures& DetectCpuFeatures() {
  static const CpuFeatures features = [] {
    __builtin_cpu_init();
    CpuFeatures f;
    // The AVX2 kernels in the binary are real: report what the CPU really has for them.
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    f.f16c = __builtin_cpu_supports("f16c");
    f.avx512f = true;  // Emulated.
    return f;
  }();
  return features;
}

std::string CpuFeaturesString(const CpuFeatures& f) {
  std::string out = f.avx2 ? "AVX2 FMA F16C " : "";
  return out + "AVX-512F (emulated by SIMDe)";
}

}  // namespace strata
