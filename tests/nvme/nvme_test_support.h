// Helpers shared by the nvme tests: aligned buffers, patterns, and the shared ScratchDir.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>

#include "strata/core/aligned_buffer.h"
#include "strata/nvme/io_engine.h"
#include "support/scratch_dir.h"

namespace strata::nvme::testing {

using strata::testing::ScratchDir;

/// Test-name suffix for suites run on each backend.
inline std::string BackendName(const ::testing::TestParamInfo<NvmeBackend>& info) {
  return info.param == NvmeBackend::kPosix ? "posix" : "io_uring";
}

inline AlignedBuffer Pattern(size_t bytes, uint32_t seed) {
  AlignedBuffer buffer = std::move(AlignedBuffer::Allocate(bytes)).value();
  std::mt19937 random(seed);
  auto* words = reinterpret_cast<uint32_t*>(buffer.data());
  for (size_t i = 0; i < buffer.size() / 4; ++i) words[i] = random();
  return buffer;
}

inline AlignedBuffer Zeroed(size_t bytes) {
  AlignedBuffer buffer = std::move(AlignedBuffer::Allocate(bytes)).value();
  std::memset(buffer.data(), 0, buffer.size());
  return buffer;
}

}  // namespace strata::nvme::testing
