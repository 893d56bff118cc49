// The collective queue on its own, through a scripted wire: what every transport with several
// ranks gets from it (order, sticky failure, names, callbacks that throw, teardown) without
// any transport's wire in the way. And the collective descriptor's sizes and names.
#include "comm/collective_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "communicator_conformance.h"
#include "strata/offload/collective.h"

namespace strata::offload {
namespace {

using internal::CollectiveWire;
using internal::MakeQueuedCommunicator;
using internal::QueuedCollective;
using testing::RunOne;

/// What a scripted wire saw, shared with the test (the queue owns the wire).
struct WireLog {
  std::mutex mutex;
  std::vector<std::string> events;  // "run #1", "skip #2: ...", "leave", "close: ...".
  /// Run's result for each number (OK when absent).
  std::function<Status(const QueuedCollective&)> run = [](const QueuedCollective&) {
    return Status();
  };
  std::function<Status(const QueuedCollective&)> admit = [](const QueuedCollective&) {
    return Status();
  };

  void Add(std::string event) {
    std::lock_guard lock(mutex);
    events.push_back(std::move(event));
  }
  std::vector<std::string> Events() {
    std::lock_guard lock(mutex);
    return events;
  }
};

class ScriptedWire final : public CollectiveWire {
 public:
  explicit ScriptedWire(std::shared_ptr<WireLog> log) : log_(std::move(log)) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  Status Admit(const QueuedCollective& queued) override { return log_->admit(queued); }
  Status Run(const QueuedCollective& queued) override {
    log_->Add("run #" + std::to_string(queued.number));
    return log_->run(queued);
  }
  void Skip(const QueuedCollective& queued, const Status& why) override {
    log_->Add("skip #" + std::to_string(queued.number) + ": " + why.message());
  }
  void Leave() override { log_->Add("leave"); }
  void Close(const Status& failed) override {
    log_->Add("close: " + (failed.ok() ? std::string("ok") : failed.message()));
  }

 private:
  std::shared_ptr<WireLog> log_;
};

std::unique_ptr<Communicator> Queue(const std::shared_ptr<WireLog>& log) {
  return MakeQueuedCommunicator(std::make_unique<ScriptedWire>(log));
}

Status AllReduce(Communicator& comm, std::vector<float>& data, CollectiveReady ready = {}) {
  return RunOne([&](CollectiveDone done) {
    comm.AllReduce(data.data(), data.size(), DType::kFp32, ReduceOp::kSum, std::move(ready),
                   std::move(done));
  });
}

TEST(CollectiveQueueTest, RunsInOrderReportingInOrder) {
  auto log = std::make_shared<WireLog>();
  auto comm = Queue(log);
  std::vector<float> data(4);
  std::mutex mutex;
  std::vector<int> reported;
  std::promise<void> last;
  constexpr int kCount = 50;
  for (int i = 1; i <= kCount; ++i) {
    comm->AllReduce(
        data.data(), data.size(), DType::kFp32, ReduceOp::kSum,
        [i] {
          // Later ones are ready sooner: the order is still the enqueueing one.
          std::this_thread::sleep_for(std::chrono::microseconds(kCount - i));
          return Status();
        },
        [&, i](Status status) {
          EXPECT_TRUE(status.ok()) << status.ToString();
          std::lock_guard lock(mutex);
          reported.push_back(i);
          if (i == kCount) last.set_value();
        });
  }
  last.get_future().wait();
  const std::vector<std::string> events = log->Events();
  ASSERT_EQ(events.size(), size_t(kCount));
  for (int i = 1; i <= kCount; ++i) {
    EXPECT_EQ(events[size_t(i - 1)], "run #" + std::to_string(i));
    EXPECT_EQ(reported[size_t(i - 1)], i);
  }
}

TEST(CollectiveQueueTest, AFailureIsStickyAndNamesTheCollective) {
  auto log = std::make_shared<WireLog>();
  log->run = [](const QueuedCollective& queued) {
    return queued.number == 2 ? IoError(queued.name + ": the link went down") : Status();
  };
  auto comm = Queue(log);
  std::vector<float> data(8);
  EXPECT_TRUE(AllReduce(*comm, data).ok());
  Status failed = AllReduce(*comm, data);
  EXPECT_EQ(failed.code(), StatusCode::kIoError);
  EXPECT_EQ(failed.message(),
            "rank 0 of 2: collective #2 (all-reduce of 8 fp32 (sum)): the link went down");
  bool ready_ran = false;
  Status later = AllReduce(*comm, data, [&] {
    ready_ran = true;
    return Status();
  });
  EXPECT_EQ(later.code(), StatusCode::kIoError);
  EXPECT_EQ(later.message(), failed.message());
  EXPECT_FALSE(ready_ran) << "a failed communicator waits for no input";
  comm.reset();
  const std::vector<std::string> expected = {"run #1", "run #2", "skip #3: " + failed.message(),
                                             "leave", "close: " + failed.message()};
  EXPECT_EQ(log->Events(), expected);
}

TEST(CollectiveQueueTest, ARefusalFailsOnlyItsCollective) {
  auto log = std::make_shared<WireLog>();
  log->admit = [](const QueuedCollective& queued) {
    return queued.collective.count > 8 ? InvalidArgument(queued.name + " is too large") : Status();
  };
  auto comm = Queue(log);
  std::vector<float> huge(16), small(8);
  bool ready_ran = false;
  Status refused = AllReduce(*comm, huge, [&] {
    ready_ran = true;
    return Status();
  });
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(ready_ran);
  EXPECT_TRUE(AllReduce(*comm, small).ok()) << "a refusal is alike on every rank: not sticky";
  comm.reset();
  EXPECT_EQ(log->Events().back(), "close: ok");
}

TEST(CollectiveQueueTest, AReadyThatFailsOrThrowsFailsTheCommunicatorWithoutRunning) {
  for (bool throws : {false, true}) {
    auto log = std::make_shared<WireLog>();
    auto comm = Queue(log);
    std::vector<float> data(8);
    Status failed = AllReduce(*comm, data, [throws]() -> Status {
      if (throws) throw std::runtime_error("no gradients");
      return IoError("no gradients");
    });
    EXPECT_EQ(failed.code(), throws ? StatusCode::kInternal : StatusCode::kIoError);
    if (throws) {
      EXPECT_EQ(failed.message(),
                "rank 0 of 2: collective #1 (all-reduce of 8 fp32 (sum)): its ready function "
                "threw: no gradients");
    }
    EXPECT_EQ(AllReduce(*comm, data).message(), failed.message());
    comm.reset();
    // The peers ran without this rank: a wire hears of it (Skip) and at Close.
    const std::vector<std::string> expected = {"skip #1: " + failed.message(),
                                               "skip #2: " + failed.message(), "leave",
                                               "close: " + failed.message()};
    EXPECT_EQ(log->Events(), expected);
  }
}

TEST(CollectiveQueueTest, ADoneThatThrowsIsItsOwnersBusiness) {
  auto log = std::make_shared<WireLog>();
  auto comm = Queue(log);
  std::vector<float> data(8);
  comm->AllReduce(data.data(), data.size(), DType::kFp32, ReduceOp::kSum, {},
                  [](Status) { throw std::runtime_error("the trainer's bug"); });
  EXPECT_TRUE(AllReduce(*comm, data).ok());
  comm.reset();
  EXPECT_EQ(log->Events().back(), "close: ok");
}

// Destroyed with collectives queued: the wire leaves first (local peers fail at once), then
// every queued collective runs (or fails) and reports, then the wire closes.
TEST(CollectiveQueueTest, DestructionLeavesThenDrainsThenCloses) {
  auto log = std::make_shared<WireLog>();
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> first_running;
  log->run = [&](const QueuedCollective& queued) {
    if (queued.number == 1) {
      first_running.set_value();
      released.wait();
    }
    return Status();
  };
  auto comm = Queue(log);
  std::vector<float> data(8);
  std::atomic<int> reported{0};
  for (int i = 0; i < 4; ++i) {
    comm->AllReduce(data.data(), data.size(), DType::kFp32, ReduceOp::kSum, {}, [&](Status status) {
      EXPECT_TRUE(status.ok());
      ++reported;
    });
  }
  first_running.get_future().wait();
  std::thread destroyer([&] { comm.reset(); });
  // Leave comes while collective #1 still runs.
  for (int i = 0; i < 1000 && log->Events().size() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(log->Events(), (std::vector<std::string>{"run #1", "leave"}));
  release.set_value();
  destroyer.join();
  EXPECT_EQ(reported.load(), 4);
  const std::vector<std::string> expected = {"run #1", "leave",  "run #2",
                                             "run #3", "run #4", "close: ok"};
  EXPECT_EQ(log->Events(), expected);
}

// On a shared executor (MPI's thread), a communicator's last owner may be its own callback:
// it goes without waiting for itself, and its wire closes after its last collective.
TEST(CollectiveQueueTest, OnASharedExecutorTheLastOwnerMayBeACallback) {
  internal::WorkerThread shared;
  auto log = std::make_shared<WireLog>();
  std::shared_ptr<Communicator> comm =
      MakeQueuedCommunicator(std::make_unique<ScriptedWire>(log), shared);
  std::vector<double> values = {1.0};
  std::promise<void> released;
  std::promise<Status> finished;
  comm->AllReduceScalars(
      values, ReduceOp::kSum,
      [ours = released.get_future().share()] {
        ours.wait();  // Until the test let go of the communicator.
        return Status();
      },
      [&finished, owner = comm](Status s) { finished.set_value(s); });
  comm.reset();
  released.set_value();
  EXPECT_TRUE(finished.get_future().get().ok());
  const std::vector<std::string> expected = {"run #1", "leave", "close: ok"};
  for (int i = 0; i < 10000 && log->Events() != expected; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(log->Events(), expected);
  shared.Stop();
  EXPECT_EQ(shared.Post([] {}).code(), StatusCode::kUnavailable);
}

// An executor that stopped refuses the collective, which reports so through its done.
TEST(CollectiveQueueTest, AStoppedExecutorFailsTheCollective) {
  internal::WorkerThread shared({}, {}, "the executor stopped");
  auto log = std::make_shared<WireLog>();
  auto comm = MakeQueuedCommunicator(std::make_unique<ScriptedWire>(log), shared);
  shared.Stop();
  std::vector<float> data(8);
  Status status = AllReduce(*comm, data);
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_EQ(status.message(), "the executor stopped");
}

TEST(CollectiveQueueTest, ANodePlaceIsOneAmongTheRanks) {
  EXPECT_TRUE(internal::CheckNodePlace({.local_rank = 1, .local_size = 2}, 4, "node").ok());
  EXPECT_EQ(internal::CheckNodePlace({.local_rank = 2, .local_size = 2}, 4, "node").code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(internal::CheckNodePlace({.local_rank = 0, .local_size = 5}, 4, "node").code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(internal::CheckNodePlace({.local_rank = -1, .local_size = 2}, 4, "node").code(),
            StatusCode::kInvalidArgument);
}

TEST(CollectiveTest, SizesFollowEachKindsCount) {
  float buffer[64] = {};
  const Collective reduce = Collective::AllReduce(buffer, 8, DType::kBf16, ReduceOp::kSum);
  EXPECT_EQ(reduce.send_bytes(4), 16u);
  EXPECT_EQ(reduce.recv_bytes(4), 16u);
  const Collective scatter =
      Collective::ReduceScatter(buffer, buffer, 8, DType::kFp32, ReduceOp::kMax);
  EXPECT_EQ(scatter.send_bytes(4), 128u);
  EXPECT_EQ(scatter.recv_bytes(4), 32u);
  EXPECT_EQ(scatter.largest_count(4), 32u);
  const Collective gather = Collective::AllGather(buffer, buffer, 8, DType::kFp16);
  EXPECT_EQ(gather.send_bytes(4), 16u);
  EXPECT_EQ(gather.recv_bytes(4), 64u);
  const Collective all_to_all = Collective::AllToAll(buffer, buffer, 8, DType::kFp32);
  EXPECT_EQ(all_to_all.send_bytes(4), 128u);
  EXPECT_EQ(all_to_all.recv_bytes(4), 128u);
  double scalars[3] = {};
  const Collective step = Collective::AllReduceScalars(scalars, 3, ReduceOp::kSum);
  EXPECT_EQ(step.send_bytes(4), 24u);
  EXPECT_EQ(step.largest_count(4), 3u);
}

TEST(CollectiveTest, DescriptionsSayWhatRuns) {
  float buffer[8] = {};
  double scalars[2] = {};
  EXPECT_EQ(Collective::AllReduce(buffer, 8, DType::kFp32, ReduceOp::kSum).Describe(),
            "all-reduce of 8 fp32 (sum)");
  EXPECT_EQ(Collective::ReduceScatter(buffer, buffer, 4, DType::kBf16, ReduceOp::kMax).Describe(),
            "reduce-scatter of 4 bf16 per rank (max)");
  EXPECT_EQ(Collective::AllGather(buffer, buffer, 4, DType::kFp16).Describe(),
            "all-gather of 4 fp16 per rank");
  EXPECT_EQ(Collective::AllToAll(buffer, buffer, 2, DType::kFp32).Describe(),
            "all-to-all of 2 fp32 per rank");
  EXPECT_EQ(Collective::AllReduceScalars(scalars, 2, ReduceOp::kSum).Describe(),
            "all-reduce of 2 step scalars");
  EXPECT_EQ(Collective::AllReduceScalars(scalars, 2, ReduceOp::kMax).Describe(),
            "all-reduce of 2 step scalars (max)");
  // What must match across ranks: not the buffers, nor an op that does not apply.
  EXPECT_TRUE(Collective::AllGather(buffer, buffer, 4, DType::kFp16)
                  .Matches(Collective::AllGather(scalars, scalars, 4, DType::kFp16)));
  EXPECT_FALSE(Collective::AllReduce(buffer, 8, DType::kFp32, ReduceOp::kSum)
                   .Matches(Collective::AllReduce(buffer, 8, DType::kFp32, ReduceOp::kMax)));
}

}  // namespace
}  // namespace strata::offload
