// IoEngine round trips on both backends (the same suite runs on io_uring and POSIX).
#include "strata/nvme/io_engine.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <future>
#include <random>
#include <vector>

#include "nvme_test_support.h"
#include "strata/core/staging_pool.h"
#include "strata/nvme/file.h"

namespace strata::nvme {
namespace {

using testing::Pattern;
using testing::ScratchDir;
using testing::Zeroed;

class IoEngineTest : public ::testing::TestWithParam<NvmeBackend> {
 protected:
  std::unique_ptr<IoEngine> MakeEngine(uint64_t block_size = 64 << 10, uint32_t depth = 8) {
    auto engine =
        IoEngine::Create({.backend = GetParam(), .block_size = block_size, .queue_depth = depth});
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    return std::move(engine).value();
  }

  File MakeFile(uint64_t bytes) {
    auto file = File::Create(dir_.path() / "data.bin", {});
    EXPECT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_TRUE(file->Reserve(bytes).ok());
    return std::move(file).value();
  }

  ScratchDir dir_;
};

TEST_P(IoEngineTest, UsesTheBackendAskedFor) {
  auto engine = MakeEngine();
  EXPECT_EQ(engine->backend_name(), GetParam() == NvmeBackend::kPosix ? "posix" : "io_uring");
}

TEST_P(IoEngineTest, RandomSizesAndOffsetsRoundTrip) {
  auto engine = MakeEngine();
  File file = MakeFile(16 << 20);
  auto id = engine->RegisterFile(file.fd(), file.path());
  ASSERT_TRUE(id.ok());
  std::mt19937 random(7);
  for (int round = 0; round < 20; ++round) {
    // Sizes that are not multiples of the block size, offsets anywhere 4 KiB-aligned.
    const size_t length = 4096 * (1 + random() % 100);
    const uint64_t offset = 4096 * (random() % ((16 << 20) / 4096 - length / 4096));
    AlignedBuffer data = Pattern(length, round);
    IoRequest write{
        .op = IoOp::kWrite, .file = *id, .offset = offset, .length = length, .buffer = data.data()};
    ASSERT_TRUE(engine->Execute(write).ok()) << write.status.ToString();
    EXPECT_EQ(write.bytes_done, length);
    AlignedBuffer back = Zeroed(length);
    IoRequest read{
        .op = IoOp::kRead, .file = *id, .offset = offset, .length = length, .buffer = back.data()};
    ASSERT_TRUE(engine->Execute(read).ok()) << read.status.ToString();
    ASSERT_EQ(std::memcmp(data.data(), back.data(), length), 0) << "round " << round;
  }
  engine->UnregisterFile(*id);
}

TEST_P(IoEngineTest, ManyRequestsInFlightCompleteOnceEach) {
  auto engine = MakeEngine(/*block_size=*/16 << 10, /*depth=*/4);
  constexpr int kRequests = 64;
  constexpr size_t kLength = 40 << 10;  // 2.5 blocks: every request is split.
  File file = MakeFile(kRequests * kLength);
  auto id = *engine->RegisterFile(file.fd(), file.path());
  AlignedBuffer data = Pattern(kRequests * kLength, 3);
  std::vector<IoRequest> requests(kRequests);
  std::atomic<int> completions{0};
  std::promise<void> all_done;
  for (int i = 0; i < kRequests; ++i) {
    requests[i] = IoRequest{.op = IoOp::kWrite,
                            .file = id,
                            .offset = i * kLength,
                            .length = kLength,
                            .buffer = data.data() + i * kLength};
    requests[i].on_complete = [&](IoRequest& r) {
      EXPECT_TRUE(r.status.ok()) << r.status.ToString();
      if (++completions == kRequests) all_done.set_value();
    };
  }
  for (auto& request : requests) engine->Submit(&request);
  all_done.get_future().wait();
  EXPECT_EQ(completions.load(), kRequests);

  AlignedBuffer back = Zeroed(kRequests * kLength);
  IoRequest read{.op = IoOp::kRead,
                 .file = id,
                 .offset = 0,
                 .length = kRequests * kLength,
                 .buffer = back.data()};
  ASSERT_TRUE(engine->Execute(read).ok());
  EXPECT_EQ(std::memcmp(data.data(), back.data(), back.size()), 0);
}

TEST_P(IoEngineTest, RegisteredBuffersWorkOrFallBack) {
  auto engine = MakeEngine();
  auto pool = *StagingPool::Create({.buffer_bytes = 256 << 10, .buffer_count = 2});
  // Either outcome is correct (RLIMIT_MEMLOCK decides); I/O must work both ways.
  engine->RegisterBuffers(pool->arena(), pool->buffer_bytes());
  File file = MakeFile(1 << 20);
  auto id = *engine->RegisterFile(file.fd(), file.path());
  StagingBuffer out = pool->Acquire(), in = pool->Acquire();
  AlignedBuffer data = Pattern(out.size(), 11);
  std::memcpy(out.data(), data.data(), out.size());
  IoRequest write{.op = IoOp::kWrite,
                  .file = id,
                  .offset = 4096,
                  .length = out.size(),
                  .buffer = out.data(),
                  .registered_buffer = static_cast<int>(out.index())};
  ASSERT_TRUE(engine->Execute(write).ok()) << write.status.ToString();
  IoRequest read{.op = IoOp::kRead,
                 .file = id,
                 .offset = 4096,
                 .length = in.size(),
                 .buffer = in.data(),
                 .registered_buffer = static_cast<int>(in.index())};
  ASSERT_TRUE(engine->Execute(read).ok()) << read.status.ToString();
  EXPECT_EQ(std::memcmp(data.data(), in.data(), in.size()), 0);
}

TEST_P(IoEngineTest, ReadPastEndOfFileFailsWithPathAndOffset) {
  auto engine = MakeEngine();
  File file = MakeFile(64 << 10);
  auto id = *engine->RegisterFile(file.fd(), file.path());
  AlignedBuffer back = Zeroed(128 << 10);
  IoRequest read{
      .op = IoOp::kRead, .file = id, .offset = 0, .length = back.size(), .buffer = back.data()};
  Status status = engine->Execute(read);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(status.message().find(file.path()), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("offset 65536"), std::string::npos) << status.message();
  EXPECT_EQ(read.bytes_done, 64u << 10) << "the bytes before the end were read";
}

TEST_P(IoEngineTest, InvalidRequestsFailAtOnce) {
  auto engine = MakeEngine();
  AlignedBuffer buffer = Zeroed(4096);
  IoRequest unknown{.op = IoOp::kRead, .file = FileId{42}, .length = 4096, .buffer = buffer.data()};
  EXPECT_EQ(engine->Execute(unknown).code(), StatusCode::kInvalidArgument);
  File file = MakeFile(4096);
  auto id = *engine->RegisterFile(file.fd(), file.path());
  IoRequest empty{.op = IoOp::kRead, .file = id, .length = 0, .buffer = buffer.data()};
  EXPECT_EQ(engine->Execute(empty).code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Backends, IoEngineTest,
                         ::testing::Values(NvmeBackend::kIoUring, NvmeBackend::kPosix),
                         testing::BackendName);

TEST(IoEngineOptionsTest, Validate) {
  EXPECT_TRUE(IoEngineOptions{}.Validate().ok());
  EXPECT_NE(IoEngineOptions{.block_size = 1000}.Validate().message().find("block_size"),
            std::string::npos);
  EXPECT_NE(IoEngineOptions{.queue_depth = 0}.Validate().message().find("queue_depth"),
            std::string::npos);
  EXPECT_EQ(*ParseNvmeBackend("posix"), NvmeBackend::kPosix);
  EXPECT_FALSE(ParseNvmeBackend("aio").ok());
}

}  // namespace
}  // namespace strata::nvme
