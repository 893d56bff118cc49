#include "strata/core/cpu_features.h"

#include <cpuid.h>

namespace strata {
namespace {

CpuFeatures Detect() {
  CpuFeatures f;
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  // AVX512_BF16 is CPUID.(EAX=7,ECX=1):EAX[5]; GCC 12's builtin list does not always have it.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (f.avx512f && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) {
    f.avx512bf16 = (eax & (1u << 5)) != 0;
  }
  return f;
}

}  // namespace

const CpuFeatures& DetectCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

std::string CpuFeaturesString(const CpuFeatures& f) {
  std::string out;
  auto add = [&out](bool present, const char* name) {
    if (!present) return;
    if (!out.empty()) out += ' ';
    out += name;
  };
  add(f.avx2, "AVX2");
  add(f.fma, "FMA");
  add(f.f16c, "F16C");
  add(f.avx512f, "AVX-512F");
  add(f.avx512bw, "AVX-512BW");
  add(f.avx512vl, "AVX-512VL");
  add(f.avx512bf16, "AVX-512BF16");
  return out.empty() ? "none" : out;
}

}  // namespace strata
