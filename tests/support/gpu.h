// What a `gpu`-labelled test does without a usable GPU: it skips, so that `ctest` on a CPU
// machine passes, unless STRATA_EXPECT_GPU=1 says a GPU is there (scripts/gpu-proof.sh sets
// it): then the missing GPU is the failure, with the reason. A driver too old for the runtime
// ("CUDA driver version is insufficient") once passed a GPU run as skips.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string_view>

namespace strata::testing {

inline bool GpuExpected() {
  const char* value = std::getenv("STRATA_EXPECT_GPU");
  return value != nullptr && std::string_view(value) == "1";
}

}  // namespace strata::testing

/// Ends the test (from a TEST body) when no GPU can be used: a skip saying `reason`, or under
/// STRATA_EXPECT_GPU=1 a failure saying it.
#define STRATA_SKIP_WITHOUT_GPU(reason)                                            \
  do {                                                                             \
    if (::strata::testing::GpuExpected()) {                                        \
      GTEST_FAIL() << "a GPU was expected (STRATA_EXPECT_GPU=1): " << (reason);    \
    }                                                                              \
    GTEST_SKIP() << (reason);                                                      \
  } while (false)
