// Helpers shared by the nvme tests: scratch directories, aligned buffers, patterns.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>

#include "strata/core/aligned_buffer.h"
#include "strata/nvme/io_engine.h"

namespace strata::nvme::testing {

/// A fresh directory under the test temp dir, removed with everything in it on destruction.
class ScratchDir {
 public:
  ScratchDir() {
    path_ = ::testing::TempDir() + "strata-nvme-XXXXXX";
    if (mkdtemp(path_.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

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
