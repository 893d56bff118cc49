// What the CPU can run, detected once at run time (CPUID plus the OS's saved-state support), so
// one binary runs everywhere and picks its kernels per machine.
#pragma once

#include <string>

namespace strata {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
};

/// Detected on first call, then cached. Thread-safe.
const CpuFeatures& DetectCpuFeatures();

/// "AVX2 FMA F16C AVX-512F ..." for logs.
std::string CpuFeaturesString(const CpuFeatures& features);

}  // namespace strata
