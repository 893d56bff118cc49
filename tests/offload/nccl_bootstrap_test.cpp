// Sharing NCCL's unique id from rank 0: over a bootstrap communicator, or through a file every
// rank sees. No GPU is needed: the id is bytes.
#include "comm/nccl_bootstrap.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <thread>
#include <vector>

#include "strata/offload/local_communicator.h"
#include "support/scratch_dir.h"

namespace strata::offload::internal {
namespace {

using strata::testing::ScratchDir;

/// 128 bytes (NCCL's id size) that differ per rank: only rank 0's may come out anywhere.
std::vector<std::byte> IdOf(int rank) {
  std::vector<std::byte> id(128);
  for (size_t i = 0; i < id.size(); ++i) id[i] = std::byte((i * 7 + size_t(rank) * 31 + 1) % 251);
  return id;
}

/// Runs ShareFromRankZero on `ranks` threads, rank r with `how(r)`.
std::vector<Result<std::vector<std::byte>>> Share(int ranks,
                                                  const std::function<IdExchange(int)>& how) {
  std::vector<Result<std::vector<std::byte>>> shared(
      size_t(ranks), Result<std::vector<std::byte>>{std::vector<std::byte>{}});
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] { shared[size_t(r)] = ShareFromRankZero(how(r), IdOf(r)); });
  }
  for (std::thread& thread : threads) thread.join();
  return shared;
}

TEST(NcclBootstrapTest, EveryRankGetsRankZerosIdOverTheBootstrap) {
  auto comms = CreateLocalCommunicators({.size = 3, .timeout_seconds = 30});
  ASSERT_TRUE(comms.ok());
  auto shared = Share(
      3, [&](int r) { return IdExchange{.rank = r, .bootstrap = (*comms)[size_t(r)].get()}; });
  for (size_t r = 0; r < shared.size(); ++r) {
    ASSERT_TRUE(shared[r].ok()) << "rank " << r << ": " << shared[r].status().ToString();
    EXPECT_EQ(*shared[r], IdOf(0)) << "rank " << r;
  }
}

// Ranks that start before rank 0 writes the file wait for it; nothing half-written is read,
// and nothing staged is left beside it.
TEST(NcclBootstrapTest, EveryRankGetsRankZerosIdThroughAFile) {
  ScratchDir dir;
  const std::filesystem::path file = dir.path() / "nccl-id";
  auto shared = Share(3, [&](int r) {
    if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return IdExchange{.rank = r, .file = file, .timeout_seconds = 30};
  });
  for (size_t r = 0; r < shared.size(); ++r) {
    ASSERT_TRUE(shared[r].ok()) << "rank " << r << ": " << shared[r].status().ToString();
    EXPECT_EQ(*shared[r], IdOf(0)) << "rank " << r;
  }
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    ++files;
    EXPECT_EQ(entry.path(), file);
  }
  EXPECT_EQ(files, 1u);
}

// A rank 0 that never writes (it died, or sees another file system) is an error naming the
// file after the timeout, not a hang; so is a file shorter than an id.
TEST(NcclBootstrapTest, AnIdThatNeverComesIsAnErrorNamingTheFile) {
  ScratchDir dir;
  const std::filesystem::path file = dir.path() / "nccl-id";
  auto missing = ShareFromRankZero({.rank = 1, .file = file, .timeout_seconds = 0.2}, IdOf(1));
  ASSERT_EQ(missing.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(missing.status().message().find(file.string()), std::string::npos)
      << missing.status().ToString();
  EXPECT_NE(missing.status().message().find("rank 1"), std::string::npos);
  {
    std::FILE* partial = std::fopen(file.c_str(), "wb");
    ASSERT_NE(partial, nullptr);
    std::fputs("short", partial);
    std::fclose(partial);
  }
  auto short_file = ShareFromRankZero({.rank = 2, .file = file, .timeout_seconds = 0.2}, IdOf(2));
  EXPECT_EQ(short_file.status().code(), StatusCode::kUnavailable);
}

TEST(NcclBootstrapTest, NeitherABootstrapNorAFileIsRefused) {
  auto shared = ShareFromRankZero({.rank = 1}, IdOf(1));
  EXPECT_EQ(shared.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(shared.status().message().find("bootstrap"), std::string::npos);
}

}  // namespace
}  // namespace strata::offload::internal
