#include "strata/core/filesystem.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

namespace strata {
namespace {

std::string MakeTempDir() {
  std::string dir = ::testing::TempDir() + "strata-fs-XXXXXX";
  EXPECT_NE(mkdtemp(dir.data()), nullptr);
  return dir;
}

TEST(FilesystemTest, ProbesTempDirectory) {
  const std::string dir = MakeTempDir();
  auto info = ProbeFilesystem(dir);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->path, dir);
  EXPECT_FALSE(info->type.empty());
  EXPECT_GT(info->total_bytes, 0u);
  EXPECT_LE(info->free_bytes, info->total_bytes);
  EXPECT_GT(info->direct_io_offset_alignment, 0u);
  EXPECT_EQ(info->direct_io_offset_alignment & (info->direct_io_offset_alignment - 1), 0u)
      << "alignment must be a power of two";
  EXPECT_FALSE(info->alignment_source.empty());
  if (!info->direct_io_supported) {
    EXPECT_FALSE(info->direct_io_error.empty());
  }
  rmdir(dir.c_str());  // The probe must leave nothing behind.
  EXPECT_NE(access(dir.c_str(), F_OK), 0);
}

TEST(FilesystemTest, MissingPathIsNotFound) {
  auto info = ProbeFilesystem("/nonexistent/strata/path");
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), StatusCode::kNotFound);
  EXPECT_NE(info.status().message().find("/nonexistent/strata/path"), std::string::npos);
}

TEST(FilesystemTest, FileIsNotADirectory) {
  const std::string dir = MakeTempDir();
  const std::string file = dir + "/plain";
  std::ofstream(file) << "x";
  auto info = ProbeFilesystem(file);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), StatusCode::kInvalidArgument);
  unlink(file.c_str());
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace strata
