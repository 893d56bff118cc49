#include "strata/nvme/swap_space.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "nvme_test_support.h"
#include "strata/nvme/extent_allocator.h"

namespace strata::nvme {
namespace {

using testing::Pattern;
using testing::ScratchDir;
using testing::Zeroed;

std::unique_ptr<IoEngine> MakeEngine() {
  return std::move(IoEngine::Create({.block_size = 256 << 10, .queue_depth = 8})).value();
}

TEST(ExtentAllocatorTest, EqualChunksReuseSpaceWithoutFragmenting) {
  ExtentAllocator allocator(64 << 20, 4096);
  std::vector<uint64_t> offsets;
  for (int i = 0; i < 16; ++i) offsets.push_back(*allocator.Allocate(4 << 20));
  EXPECT_FALSE(allocator.Allocate(1).has_value());
  std::mt19937 random(1);
  for (int round = 0; round < 200; ++round) {  // Free and reallocate in random order.
    const size_t i = random() % offsets.size();
    allocator.Free(offsets[i], 4 << 20);
    auto offset = allocator.Allocate(4 << 20);
    ASSERT_TRUE(offset.has_value());
    offsets[i] = *offset;
  }
  for (uint64_t offset : offsets) allocator.Free(offset, 4 << 20);
  EXPECT_EQ(allocator.free_bytes(), 64u << 20);
  EXPECT_EQ(allocator.free_ranges(), 1u) << "freed neighbours merge back into one range";
}

TEST(ExtentAllocatorTest, RoundsToAlignment) {
  ExtentAllocator allocator(1 << 20, 4096);
  auto a = *allocator.Allocate(1);
  auto b = *allocator.Allocate(5000);
  EXPECT_EQ(a, 0u);
  EXPECT_EQ(b, 4096u);
  EXPECT_EQ(allocator.free_bytes(), (1u << 20) - 3 * 4096);
}

TEST(SwapSpaceTest, RoundTripsRandomSizesAcrossSeveralPaths) {
  ScratchDir a, b, c;
  auto engine = MakeEngine();
  auto swap = SwapSpace::Create({.paths = {a.path(), b.path(), c.path()},
                                 .bytes_per_path = 32 << 20,
                                 .stripe_bytes = 1 << 20},
                                *engine);
  ASSERT_TRUE(swap.ok()) << swap.status().ToString();
  EXPECT_EQ((*swap)->file_paths().size(), 3u);
  std::mt19937 random(5);
  std::vector<std::pair<ExtentId, AlignedBuffer>> written;
  for (int i = 0; i < 12; ++i) {
    const size_t bytes = 1 + random() % (3 << 20);  // Any size, most not block multiples.
    AlignedBuffer data = Pattern(bytes, i);
    auto extent = (*swap)->Allocate(bytes);
    ASSERT_TRUE(extent.ok()) << extent.status().ToString();
    ASSERT_TRUE((*swap)->WriteSync(*extent, data.data(), bytes).ok());
    written.emplace_back(*extent, std::move(data));
  }
  for (auto& [extent, data] : written) {
    const uint64_t bytes = (*swap)->stored_bytes(extent);
    AlignedBuffer back = Zeroed(data.size());
    ASSERT_TRUE((*swap)->ReadSync(extent, back.data()).ok());
    EXPECT_EQ(std::memcmp(back.data(), data.data(), bytes), 0);
  }
}

TEST(SwapSpaceTest, LargeExtentsAreStripedAcrossPaths) {
  ScratchDir a, b;
  auto engine = MakeEngine();
  auto swap = *SwapSpace::Create(
      {.paths = {a.path(), b.path()}, .bytes_per_path = 16 << 20, .stripe_bytes = 4 << 20},
      *engine);
  ExtentId big = *swap->Allocate(8 << 20);
  const std::string where = swap->Describe(big);
  EXPECT_NE(where.find(a.path()), std::string::npos) << where;
  EXPECT_NE(where.find(b.path()), std::string::npos) << where;
  ExtentId small = *swap->Allocate(1 << 20);
  const std::string small_where = swap->Describe(small);
  EXPECT_TRUE((small_where.find(a.path()) == std::string::npos) !=
              (small_where.find(b.path()) == std::string::npos))
      << "a small extent lives on one path: " << small_where;
}

TEST(SwapSpaceTest, RunningOutIsResourceExhaustedWithAmounts) {
  ScratchDir dir;
  auto engine = MakeEngine();
  auto swap = *SwapSpace::Create({.paths = {dir.path()}, .bytes_per_path = 4 << 20}, *engine);
  ExtentId first = *swap->Allocate(3 << 20);
  auto second = swap->Allocate(2 << 20);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(second.status().message().find("cannot allocate 2MiB: 1MiB free of 4MiB"),
            std::string::npos)
      << second.status().message();
  swap->Free(first);
  EXPECT_TRUE(swap->Allocate(4 << 20).ok());
}

TEST(SwapSpaceTest, EnospcIsFoundAtReservation) {
  ScratchDir dir;
  struct statvfs fs {};
  ASSERT_EQ(statvfs(dir.path().c_str(), &fs), 0);
  const uint64_t more_than_free = uint64_t{fs.f_bavail} * fs.f_frsize + (uint64_t{1} << 40);
  auto engine = MakeEngine();
  auto swap = SwapSpace::Create({.paths = {dir.path()}, .bytes_per_path = more_than_free}, *engine);
  ASSERT_FALSE(swap.ok());
  EXPECT_EQ(swap.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(swap.status().message().find("cannot reserve"), std::string::npos);
  EXPECT_NE(swap.status().message().find(dir.path()), std::string::npos);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "a failed reservation leaves no file";
}

TEST(SwapSpaceTest, CorruptedByteOnDiskIsDataLoss) {
  ScratchDir dir;
  auto engine = MakeEngine();
  auto swap = *SwapSpace::Create({.paths = {dir.path()}, .bytes_per_path = 4 << 20}, *engine);
  AlignedBuffer data = Pattern(1 << 20, 8);
  ExtentId extent = *swap->Allocate(data.size());
  ASSERT_TRUE(swap->WriteSync(extent, data.data(), data.size()).ok());
  {  // Flip one byte in the swap file behind the engine's back.
    const int fd = open(swap->file_paths()[0].c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    char byte = 0;
    ASSERT_EQ(pread(fd, &byte, 1, 12345), 1);
    byte ^= 0x40;
    ASSERT_EQ(pwrite(fd, &byte, 1, 12345), 1);
    fsync(fd);
    close(fd);
  }
  AlignedBuffer back = Zeroed(data.size());
  Status status = swap->ReadSync(extent, back.data());
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_NE(status.message().find(swap->file_paths()[0]), std::string::npos) << status.message();
}

TEST(SwapSpaceTest, ChecksumsCanBeTurnedOff) {
  ScratchDir dir;
  auto engine = MakeEngine();
  auto swap = *SwapSpace::Create(
      {.paths = {dir.path()}, .bytes_per_path = 1 << 20, .checksums = false}, *engine);
  AlignedBuffer data = Pattern(8192, 1);
  ExtentId extent = *swap->Allocate(data.size());
  ASSERT_TRUE(swap->WriteSync(extent, data.data(), data.size()).ok());
  EXPECT_EQ(swap->checksum(extent), 0u);
}

TEST(SwapSpaceTest, FilesAreScratchAndLeftoversAreReplaced) {
  ScratchDir dir;
  // A swap file from a process that no longer exists (pid 0x7fffffff is never used), with the
  // header every swap file starts with.
  const std::string leftover = dir.path() / "strata-swap-2147483647-0.bin";
  std::ofstream(leftover) << "STRATA-SWAP\npid 2147483647\n";
  auto engine = MakeEngine();
  std::vector<std::string> paths;
  {
    auto swap = *SwapSpace::Create({.paths = {dir.path()}, .bytes_per_path = 1 << 20}, *engine);
    EXPECT_FALSE(std::filesystem::exists(leftover)) << "leftover from a crashed run removed";
    paths = swap->file_paths();
    ASSERT_EQ(paths.size(), 1u);
    EXPECT_TRUE(std::filesystem::exists(paths[0]));
    // The extents' space, preallocated, after a header block of its own.
    EXPECT_GE(std::filesystem::file_size(paths[0]), (1u << 20) + 4096) << "space preallocated";
    std::ifstream in(paths[0]);
    std::string magic(12, '\0');
    in.read(magic.data(), 12);
    EXPECT_EQ(magic, "STRATA-SWAP\n");
  }
  EXPECT_FALSE(std::filesystem::exists(paths[0])) << "removed on clean shutdown";
}

// Containers reuse pids: a crashed run's file may carry this process's pid. One that this
// process does not have open is a leftover all the same; one it has open is not.
TEST(SwapSpaceTest, ALeftoverOfThisPidThatIsNotOpenHereIsRemoved) {
  ScratchDir dir;
  const std::string leftover =
      dir.path() / ("strata-swap-" + std::to_string(getpid()) + "-999999.bin");
  std::ofstream(leftover) << "STRATA-SWAP\npid " << getpid() << "\n";
  auto engine = MakeEngine();
  auto first = *SwapSpace::Create({.paths = {dir.path()}, .bytes_per_path = 1 << 20}, *engine);
  EXPECT_FALSE(std::filesystem::exists(leftover));
  auto second = *SwapSpace::Create({.paths = {dir.path()}, .bytes_per_path = 1 << 20}, *engine);
  EXPECT_TRUE(std::filesystem::exists(first->file_paths()[0])) << "in use by this process";
}

TEST(SwapSpaceTest, LeavesFilesItCannotProveItsOwn) {
  ScratchDir dir;
  // Names a swap file's prefix matches but its pattern does not, a dead pid's file without the
  // header, a link to a file with it, and a live process's file: none is Strata's to remove.
  const std::vector<std::string> names = {"strata-swap-notes.txt",
                                          "strata-swap-0-1.bin",
                                          "strata-swap-2147483647-0.bin",
                                          "strata-swap-2147483647.bin",
                                          "strata-swap-2147483647-0.bin.bak",
                                          "strata-swap-" + std::to_string(getppid()) + "-0.bin"};
  for (const std::string& name : names) {
    const bool live = name == names.back();  // Only the live process's file has the header.
    std::ofstream(dir.path() / name) << (live ? "STRATA-SWAP\n" : "my notes\n");
  }
  const std::string target = dir.path() / "elsewhere.bin";
  std::ofstream(target) << "STRATA-SWAP\npid 2147483646\n";
  const std::string link = dir.path() / "strata-swap-2147483646-0.bin";
  std::filesystem::create_symlink(target, link);
  auto engine = MakeEngine();
  auto swap = *SwapSpace::Create({.paths = {dir.path()}, .bytes_per_path = 1 << 20}, *engine);
  for (const std::string& name : names) {
    EXPECT_TRUE(std::filesystem::exists(dir.path() / name)) << name;
  }
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_TRUE(std::filesystem::exists(target));
}

TEST(SwapSpaceTest, BadPathsAreClearErrors) {
  auto engine = MakeEngine();
  auto missing =
      SwapSpace::Create({.paths = {"/nonexistent/nvme"}, .bytes_per_path = 4096}, *engine);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/nvme"), std::string::npos);
  auto none = SwapSpace::Create({.bytes_per_path = 4096}, *engine);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("nvme_path"), std::string::npos);
}

TEST(SwapSpaceTest, PathWithoutODirectIsAnErrorUnlessFallbackAllowed) {
  ScratchDir probe_dir;  // On the normal temp file system.
  const std::string shm = "/dev/shm";
  const std::string test_file = shm + "/strata-dio-check";
  const int fd = open(test_file.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd >= 0) {
    close(fd);
    unlink(test_file.c_str());
    GTEST_SKIP() << shm << " supports O_DIRECT on this kernel; no file system here refuses it";
  }
  auto engine = MakeEngine();
  auto strict = SwapSpace::Create({.paths = {shm}, .bytes_per_path = 1 << 20}, *engine);
  ASSERT_FALSE(strict.ok());
  EXPECT_NE(strict.status().message().find("does not support O_DIRECT"), std::string::npos);
  auto relaxed = SwapSpace::Create(
      {.paths = {shm}, .bytes_per_path = 1 << 20, .allow_buffered_fallback = true}, *engine);
  EXPECT_TRUE(relaxed.ok()) << relaxed.status().ToString();
}

}  // namespace
}  // namespace strata::nvme
