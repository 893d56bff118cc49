// The collective queue: what every transport with several ranks shares, written once. A
// transport (local, MPI, NCCL) implements only its wire — how one collective's bytes move —
// and the queue does the rest of the Communicator contract:
//   - collectives run one at a time, in the order enqueued, on an executor: a thread of the
//     communicator's own (WorkerThread) or one the process shares (MPI's);
//   - each waits for its `ready` (an exception from it fails the collective instead of ending
//     the process) and reports through `done` (whose exceptions are its owner's business);
//   - the first failure is sticky: every later collective reports it without running, since
//     ranks that went on would disagree about which collective comes next;
//   - errors name the collective: "rank r of n: collective #k (all-reduce of 8 fp32 (sum))".
// A queue's state lives in a shared_ptr its jobs hold, so a job may outlive its communicator
// (MPI's last owner can be a callback on the shared thread).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "strata/core/status.h"
#include "strata/offload/communicator.h"

namespace strata::offload::internal {

/// Where a queue's jobs run, one at a time in the order posted.
class Executor {
 public:
  virtual ~Executor() = default;
  /// Runs `job` after every job posted before it. An error (and `job` dropped, without
  /// running) when the executor has stopped.
  virtual Status Post(std::function<void()> job) = 0;
  /// Whether the caller is the executor's thread (which must never wait for its own jobs).
  virtual bool on_thread() const = 0;
};

/// One thread that runs the jobs posted to it in order.
class WorkerThread final : public Executor {
 public:
  /// `first` runs on the thread before any job, `last` after the final one (MPI initializes and
  /// finalizes there); `stopped` is the error Post returns once the thread stopped.
  explicit WorkerThread(std::function<void()> first = {}, std::function<void()> last = {},
                        std::string stopped = "the communicator's thread has stopped");
  /// Stops (running every job posted first). From the thread itself (a job that destroys its
  /// own communicator) it cannot wait for itself and what it would destroy is in use: abort.
  ~WorkerThread() override;
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;

  Status Post(std::function<void()> job) override;
  bool on_thread() const override;

  /// Runs the jobs posted so far, then `last`, and ends the thread; later posts are refused.
  /// From the thread itself (a callback that exits the process) it cannot wait for itself:
  /// the thread is detached. Idempotent.
  void Stop();

 private:
  void Main();

  std::function<void()> first_;
  std::function<void()> last_;
  const std::string stopped_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;  // Last: starts once everything it uses exists.
};

/// One collective as the queue hands it to a wire.
struct QueuedCollective {
  uint64_t number = 0;  ///< Its position in this communicator's sequence, from 1.
  Collective collective;
  std::string name;  ///< "rank r of n: collective #k (...)": how errors name it.
};

/// How a transport moves a collective's bytes. Every call but Leave is on the queue's executor,
/// one at a time; none overlaps another on the same wire.
class CollectiveWire {
 public:
  virtual ~CollectiveWire() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual NodePlace node() const { return {rank(), size()}; }

  /// Refuses, before its input is awaited, a collective this wire cannot carry (MPI's int
  /// counts). A refusal is alike on every rank and moves nothing, so it fails that collective
  /// only: the communicator is not failed.
  virtual Status Admit(const QueuedCollective& /*queued*/) { return Status(); }
  /// Runs a collective whose input is ready, on every rank, until done, failed or timed out.
  virtual Status Run(const QueuedCollective& queued) = 0;
  /// This rank will not run `queued`: its input failed (`why`), or an earlier collective did.
  /// For a wire whose peers can be told (local ranks) rather than left to time out.
  virtual void Skip(const QueuedCollective& /*queued*/, const Status& /*why*/) {}

  /// The communicator is being destroyed, before its queued collectives drain: on the
  /// destroying thread, concurrently with Run. Local ranks fail peers waiting for them at once.
  virtual void Leave() {}
  /// After the last collective ran: `failed` is the communicator's sticky failure (OK when none
  /// failed, input included), which says whether peers may still wait in a collective (NCCL
  /// aborts then, and finalizes otherwise).
  virtual void Close(const Status& /*failed*/) {}
};

/// InvalidArgument unless `node` is a place among `size` ranks (0 <= local_rank < local_size
/// <= size); `what` names the option.
Status CheckNodePlace(const NodePlace& node, int size, const std::string& what);

/// A Communicator that runs `wire` on a WorkerThread of its own (local ranks, NCCL).
std::unique_ptr<Communicator> MakeQueuedCommunicator(std::unique_ptr<CollectiveWire> wire);

/// The same on an executor the process shares (MPI's thread), which must outlive the
/// communicator. The communicator's destructor waits for its jobs, unless on that executor.
std::unique_ptr<Communicator> MakeQueuedCommunicator(std::unique_ptr<CollectiveWire> wire,
                                                     Executor& shared);

}  // namespace strata::offload::internal
