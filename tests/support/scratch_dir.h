// ScratchDir: a fresh directory for one test, removed with everything in it on destruction.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace strata::testing {

class ScratchDir {
 public:
  /// Creates "<gtest's TempDir()><prefix>-XXXXXX" (TempDir() is /tmp/ unless TEST_TMPDIR says
  /// otherwise; a real file system, so O_DIRECT works there).
  explicit ScratchDir(const std::string& prefix = "strata") {
    std::string pattern = ::testing::TempDir() + prefix + "-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp " << pattern << " failed";
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace strata::testing
