// NVMe I/O awaited from coroutines on the event loop.
#include "strata/nvme/async_io.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <future>
#include <vector>

#include "nvme_test_support.h"

namespace strata::nvme {
namespace {

using testing::Pattern;
using testing::ScratchDir;
using testing::Zeroed;

TEST(AsyncIoTest, CoroutineAwaitsSwapWriteAndVerifiedRead) {
  ScratchDir dir;
  EventLoop loop;
  auto engine = *IoEngine::Create({.block_size = 64 << 10, .queue_depth = 4});
  auto swap = *SwapSpace::Create({.paths = {dir.path()}, .bytes_per_path = 4 << 20}, *engine);
  AlignedBuffer data = Pattern(1 << 20, 21);
  AlignedBuffer back = Zeroed(1 << 20);
  ExtentId extent = *swap->Allocate(data.size());

  struct Outcome {
    Status write, read;
    bool resumed_on_loop = false;
  };
  Outcome outcome = loop.Run([&]() -> Awaitable<Outcome> {
    Outcome o;
    o.write = co_await AwaitSwapWrite(*swap, extent, data.data(), data.size());
    o.read = co_await AwaitSwapRead(*swap, extent, back.data());
    o.resumed_on_loop = loop.InLoopThread();
    co_return o;
  }());
  EXPECT_TRUE(outcome.write.ok()) << outcome.write.ToString();
  EXPECT_TRUE(outcome.read.ok()) << outcome.read.ToString();
  EXPECT_TRUE(outcome.resumed_on_loop);
  EXPECT_EQ(std::memcmp(back.data(), data.data(), data.size()), 0);
}

TEST(AsyncIoTest, ManyCoroutinesShareTheEngine) {
  ScratchDir dir;
  EventLoop loop;
  auto engine = *IoEngine::Create({.block_size = 16 << 10, .queue_depth = 8});
  auto swap = *SwapSpace::Create({.paths = {dir.path()}, .bytes_per_path = 8 << 20}, *engine);
  constexpr int kChunks = 16;
  std::vector<AlignedBuffer> data, back;
  std::vector<ExtentId> extents;
  for (int i = 0; i < kChunks; ++i) {
    data.push_back(Pattern(256 << 10, i));
    back.push_back(Zeroed(256 << 10));
    extents.push_back(*swap->Allocate(256 << 10));
  }
  std::atomic<int> ok{0}, finished{0};
  std::promise<void> all_done;
  for (int i = 0; i < kChunks; ++i) {
    boost::asio::co_spawn(
        loop.context(),
        [&, i]() -> Awaitable<void> {
          Status s = co_await AwaitSwapWrite(*swap, extents[i], data[i].data(), data[i].size());
          if (s.ok()) s = co_await AwaitSwapRead(*swap, extents[i], back[i].data());
          if (s.ok() && std::memcmp(back[i].data(), data[i].data(), data[i].size()) == 0) ++ok;
          if (++finished == kChunks) all_done.set_value();
        },
        boost::asio::detached);
  }
  all_done.get_future().wait();
  EXPECT_EQ(ok.load(), kChunks);
}

TEST(AsyncIoTest, AwaitIoReportsErrors) {
  EventLoop loop;
  auto engine = *IoEngine::Create({});
  AlignedBuffer buffer = Zeroed(4096);
  IoRequest request{.op = IoOp::kRead, .file = FileId{7}, .length = 4096, .buffer = buffer.data()};
  Status status =
      loop.Run([&]() -> Awaitable<Status> { co_return co_await AwaitIo(*engine, request); }());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::nvme
