#include "strata/core/event_loop.h"

#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "strata/core/host_device.h"

namespace strata {
namespace {

/// Records, from the loop thread, the order in which completions arrive.
class Arrivals {
 public:
  void Add(std::string name, bool on_loop_thread) {
    std::lock_guard lock(mutex_);
    names_.push_back(std::move(name));
    all_on_loop_ &= on_loop_thread;
    changed_.notify_all();
  }
  void WaitForCount(size_t n) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return names_.size() >= n; });
  }
  std::vector<std::string> names() {
    std::lock_guard lock(mutex_);
    return names_;
  }
  bool all_on_loop() {
    std::lock_guard lock(mutex_);
    return all_on_loop_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::string> names_;
  bool all_on_loop_ = true;
};

TEST(EventLoopTest, RunReturnsCoroutineValue) {
  EventLoop loop;
  int value = loop.Run([]() -> Awaitable<int> { co_return 42; }());
  EXPECT_EQ(value, 42);
}

TEST(EventLoopTest, AwaitJobRunsOffLoopAndReturnsValue) {
  EventLoop loop;
  JobThreads threads(2);
  auto result = loop.Run([&]() -> Awaitable<std::pair<bool, int>> {
    bool job_on_loop = true;
    int sum = co_await AwaitJob(threads, [&] {
      job_on_loop = loop.InLoopThread();
      return 20 + 22;
    });
    co_await AwaitJob(threads, [] {});  // void jobs work too
    co_return std::make_pair(job_on_loop, sum);
  }());
  EXPECT_FALSE(result.first);
  EXPECT_EQ(result.second, 42);
}

// Three sources complete in an order the test dictates (fd, then device, then job — the
// reverse of the order they were started), each only after the loop has shown it is still
// free to run other handlers. Completions must arrive on the loop thread in that order.
TEST(EventLoopTest, CompletionsFromSeveralSourcesArriveInOrderWithoutBlocking) {
  EventLoop loop;
  auto device = *CreateHostDevice();
  JobThreads threads(1);
  const int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  ASSERT_GE(fd, 0);

  std::promise<void> release_job, release_device;
  std::shared_future<void> job_gate = release_job.get_future().share();
  std::shared_future<void> device_gate = release_device.get_future().share();
  Arrivals arrivals;

  auto spawn = [&](std::string name, auto make_awaitable) {
    boost::asio::co_spawn(
        loop.context(),
        [&, name, make_awaitable]() -> Awaitable<void> {
          co_await make_awaitable();
          arrivals.Add(name, loop.InLoopThread());
        },
        boost::asio::detached);
  };
  // Gates captured by reference: they outlive every completion, and GCC 12 destroys a lambda
  // with non-trivial captures twice when it is written inline in co_await (see AwaitJob).
  spawn("job",
        [&]() -> Awaitable<void> { co_await AwaitJob(threads, [&job_gate] { job_gate.wait(); }); });
  spawn("device", [&]() -> Awaitable<void> {
    EXPECT_TRUE(
        device->LaunchHostFunction(Stream::kCompute, [&device_gate] { device_gate.wait(); }).ok());
    Status s = co_await AwaitStream(*device, Stream::kCompute);
    EXPECT_TRUE(s.ok());
  });
  spawn("fd", [&]() -> Awaitable<void> {
    Status s = co_await AwaitReadable(fd);
    EXPECT_TRUE(s.ok());
  });

  // All three are pending; the loop must still run a fresh handler promptly.
  auto loop_is_free = [&] {
    std::promise<bool> ran;
    boost::asio::post(loop.context(), [&] { ran.set_value(loop.InLoopThread()); });
    return ran.get_future().get();
  };
  EXPECT_TRUE(loop_is_free());
  EXPECT_TRUE(arrivals.names().empty());

  const uint64_t one = 1;
  ASSERT_EQ(write(fd, &one, sizeof(one)), static_cast<ssize_t>(sizeof(one)));
  arrivals.WaitForCount(1);
  EXPECT_TRUE(loop_is_free());
  release_device.set_value();
  arrivals.WaitForCount(2);
  EXPECT_TRUE(loop_is_free());
  release_job.set_value();
  arrivals.WaitForCount(3);

  EXPECT_EQ(arrivals.names(), (std::vector<std::string>{"fd", "device", "job"}));
  EXPECT_TRUE(arrivals.all_on_loop());
  close(fd);
}

TEST(EventLoopTest, AwaitReadableReportsBadFd) {
  EventLoop loop;
  Status s = loop.Run([]() -> Awaitable<Status> { co_return co_await AwaitReadable(-1); }());
  EXPECT_FALSE(s.ok());
}

}  // namespace
}  // namespace strata
