#include "comm/collective_queue.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>
#include <utility>

namespace strata::offload::internal {

WorkerThread::WorkerThread(std::function<void()> first, std::function<void()> last,
                           std::string stopped)
    : first_(std::move(first)),
      last_(std::move(last)),
      stopped_(std::move(stopped)),
      thread_([this] { Main(); }) {}

WorkerThread::~WorkerThread() {
  if (on_thread()) {
    std::fprintf(stderr, "strata: a communicator was destroyed from its own callback\n");
    std::abort();
  }
  Stop();
}

Status WorkerThread::Post(std::function<void()> job) {
  std::lock_guard lock(mutex_);
  if (stopping_) return Unavailable(stopped_);
  jobs_.push_back(std::move(job));
  wake_.notify_one();
  return Status();
}

bool WorkerThread::on_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

void WorkerThread::Stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    wake_.notify_one();
  }
  if (on_thread()) {
    thread_.detach();
  } else if (thread_.joinable()) {
    thread_.join();
  }
}

void WorkerThread::Main() {
  if (first_) first_();
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) break;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
  if (last_) last_();
}

namespace {

/// Calls `done` with `status`; an exception from it is its owner's to report.
void Report(const CollectiveDone& done, Status status) {
  if (!done) return;
  try {
    done(std::move(status));
  } catch (...) {
    // Nothing to tell: the callback's own failure is its owner's to report.
  }
}

/// What a communicator's jobs share with it (and may keep after it is gone).
class QueueState {
 public:
  explicit QueueState(std::unique_ptr<CollectiveWire> wire) : wire_(std::move(wire)) {}

  CollectiveWire& wire() { return *wire_; }

  /// One collective, start to end. Executor thread.
  void Run(uint64_t number, const Collective& collective, const CollectiveReady& ready,
           const CollectiveDone& done) {
    const QueuedCollective queued{number, collective, Name(number, collective)};
    Status status = failed_;
    bool refused = false;
    if (status.ok()) {
      status = wire_->Admit(queued);
      refused = !status.ok();
    }
    if (status.ok() && ready) {
      try {
        status = ready();
      } catch (const std::exception& e) {
        status = Internal(queued.name + ": its ready function threw: " + e.what());
      }
    }
    if (status.ok()) {
      status = wire_->Run(queued);
    } else {
      wire_->Skip(queued, status);
    }
    // A failed collective (or input, which the peers ran without this rank) fails every later
    // one, as Communicator says; a refusal was alike on every rank, which stay in step.
    if (!status.ok() && !refused && failed_.ok()) failed_ = status;
    Report(done, std::move(status));
  }

  /// After the last job. Executor thread.
  void Close() { wire_->Close(failed_); }

 private:
  std::string Name(uint64_t number, const Collective& collective) const {
    return "rank " + std::to_string(wire_->rank()) + " of " + std::to_string(wire_->size()) +
           ": collective #" + std::to_string(number) + " (" + collective.Describe() + ")";
  }

  const std::unique_ptr<CollectiveWire> wire_;
  Status failed_;  // Executor thread only: the first failure, which every later one reports.
};

class QueuedCommunicator final : public Communicator {
 public:
  QueuedCommunicator(std::unique_ptr<CollectiveWire> wire, std::unique_ptr<WorkerThread> own,
                     Executor& executor)
      : state_(std::make_shared<QueueState>(std::move(wire))),
        rank_(state_->wire().rank()),
        size_(state_->wire().size()),
        node_(state_->wire().node()),
        own_executor_(std::move(own)),
        executor_(executor) {}

  ~QueuedCommunicator() override {
    state_->wire().Leave();
    // Behind every collective enqueued: they run (or fail) first. Waited for, unless this is
    // the executor's thread (a callback held the last reference), which cannot wait for
    // itself; an own thread then aborts (~WorkerThread).
    auto closed = std::make_shared<std::promise<void>>();
    std::future<void> finished = closed->get_future();
    const Status posted = executor_.Post([state = state_, closed] {
      state->Close();
      closed->set_value();
    });
    if (posted.ok() && !executor_.on_thread()) finished.wait();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  NodePlace node() const override { return node_; }

  void Enqueue(const Collective& collective, CollectiveReady ready, CollectiveDone done) override {
    const uint64_t number = ++enqueued_;
    // Shared with the job so that `done` is still here to report a refused post.
    auto callbacks = std::make_shared<std::pair<CollectiveReady, CollectiveDone>>(std::move(ready),
                                                                                  std::move(done));
    Status posted = executor_.Post([state = state_, number, collective, callbacks] {
      state->Run(number, collective, callbacks->first, callbacks->second);
    });
    if (!posted.ok()) Report(callbacks->second, std::move(posted));
  }

 private:
  std::shared_ptr<QueueState> state_;
  const int rank_;
  const int size_;
  const NodePlace node_;
  uint64_t enqueued_ = 0;  // Enqueueing thread.
  std::unique_ptr<WorkerThread> own_executor_;
  Executor& executor_;
};

}  // namespace

Status CheckNodePlace(const NodePlace& node, int size, const std::string& what) {
  if (node.local_size < 1 || node.local_size > size || node.local_rank < 0 ||
      node.local_rank >= node.local_size) {
    return InvalidArgument(what + ": local rank " + std::to_string(node.local_rank) + " of " +
                           std::to_string(node.local_size) + " is not a place among " +
                           std::to_string(size) + " ranks");
  }
  return Status();
}

std::unique_ptr<Communicator> MakeQueuedCommunicator(std::unique_ptr<CollectiveWire> wire) {
  auto thread = std::make_unique<WorkerThread>();
  Executor& executor = *thread;
  return std::make_unique<QueuedCommunicator>(std::move(wire), std::move(thread), executor);
}

std::unique_ptr<Communicator> MakeQueuedCommunicator(std::unique_ptr<CollectiveWire> wire,
                                                     Executor& shared) {
  return std::make_unique<QueuedCommunicator>(std::move(wire), nullptr, shared);
}

}  // namespace strata::offload::internal
