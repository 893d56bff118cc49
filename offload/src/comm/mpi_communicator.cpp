#include "strata/offload/mpi_communicator.h"

#include <cmath>
#include <string>

#include "comm/collective_peers.h"

#if STRATA_WITH_MPI
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>
#endif

namespace strata::offload {

#if !STRATA_WITH_MPI

bool MpiAvailable() { return false; }

Result<std::unique_ptr<Communicator>> CreateMpiCommunicator(const MpiCommunicatorOptions&) {
  return Unavailable(
      "this build has no MPI: install Open MPI (libopenmpi-dev) and configure again "
      "(STRATA_WITH_MPI)");
}

#else

namespace {

using Clock = std::chrono::steady_clock;

std::string MpiErrorText(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    return "MPI error " + std::to_string(code);
  }
  return std::string(text, size_t(length));
}

std::string Seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", seconds);
  return text;
}

/// The one thread of the process that calls MPI, shared by every communicator: it runs their
/// jobs one at a time in the order posted. It initializes MPI when it starts (for every thread,
/// MPI_THREAD_MULTIPLE), unless the trainer did, and finalizes it at process exit (an atexit
/// handler; the object itself is never destroyed, so a communicator that outlives the handler
/// finds it stopped rather than freed) — unless the trainer finalized MPI already, or a
/// collective that timed out is still not complete a few seconds later (its peer is dead): then
/// it leaves MPI as it is, so the process exits and mpirun takes the job down instead of every
/// rank hanging in MPI_Finalize.
class MpiThread {
 public:
  static MpiThread& Get() {
    static MpiThread* const thread = [] {
      auto* created = new MpiThread;
      std::atexit([] { Get().Stop(); });
      return created;
    }();
    return *thread;
  }

  /// How starting MPI went.
  const Status& started() const { return started_; }
  bool on_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

  /// Runs `job` on the MPI thread after every job posted before it; false (and `job` dropped)
  /// once the thread stopped at exit.
  bool Post(std::function<void()> job) {
    std::lock_guard lock(mutex_);
    if (stopping_) return false;
    jobs_.push_back(std::move(job));
    wake_.notify_one();
    return true;
  }

  /// A collective that timed out, with what it may still write: MPI is finalized only if it
  /// completes after all. MPI thread.
  void Abandon(MPI_Request request, std::shared_ptr<void> buffers) {
    abandoned_.push_back({request, std::move(buffers)});
  }

 private:
  struct Abandoned {
    MPI_Request request;
    std::shared_ptr<void> buffers;  // Kept for MPI to write into until the process ends.
  };

  MpiThread() {
    std::promise<Status> started;
    std::future<Status> result = started.get_future();
    thread_ = std::thread([this, started = std::move(started)]() mutable { Main(started); });
    started_ = result.get();
  }

  /// Runs the jobs posted so far, then finalizes MPI. From exit on the MPI thread itself (a
  /// callback that exits), it cannot wait for itself: MPI is left as it is.
  void Stop() {
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

  void Main(std::promise<Status>& started) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    bool owner = false;
    if (finalized) {
      started.set_value(Unavailable("MPI was already finalized in this process"));
    } else if (initialized) {
      int provided = MPI_THREAD_SINGLE;
      MPI_Query_thread(&provided);
      started.set_value(provided >= MPI_THREAD_MULTIPLE
                            ? Status()
                            : Unavailable("MPI was initialized by the trainer without "
                                          "MPI_THREAD_MULTIPLE; Strata calls MPI from a thread "
                                          "of its own, so initialize it with that level"));
    } else {
      int provided = MPI_THREAD_SINGLE;
      const int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      owner = code == MPI_SUCCESS;
      // Below MULTIPLE, only this thread may call MPI: enough for Strata, which says so.
      started.set_value(owner ? Status() : Internal("MPI_Init_thread: " + MpiErrorText(code)));
    }
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
    MPI_Finalized(&finalized);
    if (owner && !finalized && AbandonedComplete()) MPI_Finalize();
  }

  /// Whether every abandoned collective completed, given a grace period for late peers.
  bool AbandonedComplete() {
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    for (Abandoned& abandoned : abandoned_) {
      int finished = 0;
      while (MPI_Test(&abandoned.request, &finished, MPI_STATUS_IGNORE) == MPI_SUCCESS &&
             !finished) {
        if (Clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!finished) return false;
    }
    return true;
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::vector<Abandoned> abandoned_;  // MPI thread only.
  Status started_;
  std::thread thread_;
};

/// Element-wise reductions of 16-bit floats, which MPI has no type for: each pair is reduced
/// in fp32 and rounded back once. A NaN wins a max, as it does a sum.
template <float (*ToFp32)(uint16_t), uint16_t (*FromFp32)(float), bool kMax>
void Reduce16(void* in, void* inout, int* length, MPI_Datatype* /*type*/) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *length; ++i) {
    const float x = ToFp32(a[i]), y = ToFp32(b[i]);
    b[i] = FromFp32(kMax ? (std::isnan(x) || x > y ? x : y) : x + y);
  }
}

/// The MPI types and operations of each dtype, made once on the MPI thread.
struct MpiTypes {
  MPI_Datatype half = MPI_DATATYPE_NULL;
  MPI_Op ops[2][2] = {};  // [fp16, bf16][sum, max]

  MpiTypes() {
    MPI_Type_contiguous(2, MPI_BYTE, &half);
    MPI_Type_commit(&half);
    MPI_Op_create(&Reduce16<Fp16ToFp32, Fp32ToFp16, false>, 1, &ops[0][0]);
    MPI_Op_create(&Reduce16<Fp16ToFp32, Fp32ToFp16, true>, 1, &ops[0][1]);
    MPI_Op_create(&Reduce16<Bf16ToFp32, Fp32ToBf16, false>, 1, &ops[1][0]);
    MPI_Op_create(&Reduce16<Bf16ToFp32, Fp32ToBf16, true>, 1, &ops[1][1]);
  }

  MPI_Datatype Type(DType dtype) const { return dtype == DType::kFp32 ? MPI_FLOAT : half; }
  MPI_Op Op(DType dtype, ReduceOp op) const {
    if (dtype == DType::kFp32) return op == ReduceOp::kSum ? MPI_SUM : MPI_MAX;
    return ops[dtype == DType::kBf16 ? 1 : 0][op == ReduceOp::kSum ? 0 : 1];
  }
};

const MpiTypes& Types() {  // MPI thread only.
  static const MpiTypes types;
  return types;
}

/// Polls `request` until it completes or `timeout_seconds` pass. MPI thread. On a timeout the
/// request is handed to the MPI thread with `buffers`, which MPI may still write; `peers` says
/// who it waited for.
Status Await(MPI_Request request, double timeout_seconds, const std::string& name,
             std::shared_ptr<void> buffers, const std::string& peers = "another rank") {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds);
  auto pause = std::chrono::microseconds(0);
  for (;;) {
    int finished = 0;
    if (const int code = MPI_Test(&request, &finished, MPI_STATUS_IGNORE); code != MPI_SUCCESS) {
      return Internal(name + " failed: " + MpiErrorText(code));
    }
    if (finished) return Status();
    if (Clock::now() > deadline) {
      MpiThread::Get().Abandon(request, std::move(buffers));
      return Unavailable(name + " did not complete within " + Seconds(timeout_seconds) + ": " +
                         peers +
                         " died, hangs or stopped enqueueing the same collectives "
                         "(MpiCommunicatorOptions::timeout_seconds)");
    }
    // Short collectives finish within the first polls; long ones are polled at most 1 ms
    // apart.
    if (pause.count() > 0) std::this_thread::sleep_for(pause);
    pause = std::min(std::chrono::microseconds(1000),
                     pause + std::chrono::microseconds(pause.count() < 50 ? 5 : 50));
  }
}

/// What a communicator's queued jobs share with it: they may outlive it (the last owner of a
/// communicator can be one of its own callbacks, on the MPI thread).
struct CommState {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  double timeout_seconds = 0;
  // MPI thread only: the first failure, which every later collective reports, and whether a
  // collective timed out (the communicator then stays: freeing it under a request MPI may
  // still complete crashes its progress engine).
  Status failed;
  bool timed_out = false;
};

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(std::shared_ptr<CommState> state) : state_(std::move(state)) {}

  ~MpiCommunicator() override {
    // Behind every collective enqueued: they run (or fail) first. Waited for, unless this is
    // the MPI thread (a callback held the last reference), which cannot wait for itself.
    auto freed = std::make_shared<std::promise<void>>();
    std::future<void> done = freed->get_future();
    const bool posted = MpiThread::Get().Post([state = state_, freed] {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized && !state->timed_out) MPI_Comm_free(&state->comm);
      freed->set_value();
    });
    if (posted && !MpiThread::Get().on_thread()) done.wait();
  }

  int rank() const override { return state_->rank; }
  int size() const override { return state_->size; }

  void AllReduce(void* data, size_t count, DType dtype, ReduceOp op, CollectiveReady ready,
                 CollectiveDone done) override {
    Enqueue("all-reduce of " + std::to_string(count) + " elements", count, std::move(ready),
            std::move(done), [=](MPI_Comm comm, MPI_Request* request) {
              return MPI_Iallreduce(MPI_IN_PLACE, data, int(count), Types().Type(dtype),
                                    Types().Op(dtype, op), comm, request);
            });
  }

  void ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op,
                     CollectiveReady ready, CollectiveDone done) override {
    Enqueue("reduce-scatter of " + std::to_string(recv_count) + " elements per rank",
            recv_count * size_t(size()), std::move(ready), std::move(done),
            [=](MPI_Comm comm, MPI_Request* request) {
              return MPI_Ireduce_scatter_block(send, recv, int(recv_count), Types().Type(dtype),
                                               Types().Op(dtype, op), comm, request);
            });
  }

  void AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                 CollectiveReady ready, CollectiveDone done) override {
    Enqueue("all-gather of " + std::to_string(send_count) + " elements per rank",
            send_count * size_t(size()), std::move(ready), std::move(done),
            [=, rank = rank()](MPI_Comm comm, MPI_Request* request) {
              // MPI forbids overlapping buffers; its own slot of recv is MPI_IN_PLACE.
              const bool in_place = send == static_cast<const std::byte*>(recv) +
                                                size_t(rank) * send_count * DTypeSize(dtype);
              return MPI_Iallgather(in_place ? MPI_IN_PLACE : send, int(send_count),
                                    Types().Type(dtype), recv, int(send_count), Types().Type(dtype),
                                    comm, request);
            });
  }

  void AllToAll(const void* send, void* recv, size_t count, DType dtype, CollectiveReady ready,
                CollectiveDone done) override {
    Enqueue("all-to-all of " + std::to_string(count) + " elements per rank", count * size_t(size()),
            std::move(ready), std::move(done), [=](MPI_Comm comm, MPI_Request* request) {
              return MPI_Ialltoall(send, int(count), Types().Type(dtype), recv, int(count),
                                   Types().Type(dtype), comm, request);
            });
  }

  void AllReduceScalars(std::span<double> values, ReduceOp op, CollectiveReady ready,
                        CollectiveDone done) override {
    // MPI works on a copy the job owns, copied back on success: a collective that times out
    // may complete later, and the caller's span (a local, often) is gone by then.
    auto copy = std::make_shared<std::vector<double>>();
    Enqueue(
        "all-reduce of " + std::to_string(values.size()) + " step scalars", values.size(),
        [ready = std::move(ready), values, copy]() -> Status {
          Status status = ready ? ready() : Status();
          copy->assign(values.begin(), values.end());
          return status;
        },
        [done = std::move(done), values, copy](Status status) {
          if (status.ok()) std::copy(copy->begin(), copy->end(), values.begin());
          if (done) done(std::move(status));
        },
        [copy, op](MPI_Comm comm, MPI_Request* request) {
          return MPI_Iallreduce(MPI_IN_PLACE, copy->data(), int(copy->size()), MPI_DOUBLE,
                                op == ReduceOp::kSum ? MPI_SUM : MPI_MAX, comm, request);
        },
        copy);
  }

 private:
  using Start = std::function<int(MPI_Comm, MPI_Request*)>;

  /// Queues one collective of `count` elements. `buffers`: what MPI may still write should it
  /// time out and complete later (kept to the end of the process).
  void Enqueue(std::string what, size_t count, CollectiveReady ready, CollectiveDone done,
               Start start, std::shared_ptr<void> buffers = nullptr) {
    const uint64_t number = ++enqueued_;
    auto job = [state = state_, number, count, what = std::move(what), ready = std::move(ready),
                done = std::move(done), start = std::move(start),
                buffers = std::move(buffers)]() mutable {
      const std::string name = "rank " + std::to_string(state->rank) + " of " +
                               std::to_string(state->size) + ": collective #" +
                               std::to_string(number) + " (" + what + ")";
      Status status = state->failed;
      // MPI counts are ints: refused alike on every rank, before any MPI call.
      if (status.ok() && count > size_t(std::numeric_limits<int>::max())) {
        status = InvalidArgument(name + " is larger than MPI's int counts allow");
      }
      if (status.ok() && ready) {
        try {
          status = ready();
        } catch (const std::exception& e) {
          status = Internal(name + ": its ready function threw: " + e.what());
        }
      }
      if (status.ok()) {
        MPI_Request request = MPI_REQUEST_NULL;
        if (const int code = start(state->comm, &request); code != MPI_SUCCESS) {
          status = Internal(name + " could not start: " + MpiErrorText(code));
        } else {
          status = Await(request, state->timeout_seconds, name, std::move(buffers),
                         internal::PeersOf(state->rank, state->size));
          if (!status.ok() && status.code() == StatusCode::kUnavailable) state->timed_out = true;
        }
      }
      if (!status.ok() && status.code() != StatusCode::kInvalidArgument && state->failed.ok()) {
        state->failed = status;
      }
      if (!done) return;
      try {
        done(std::move(status));
      } catch (...) {
        // Nothing to tell: the callback's own failure is its owner's to report.
      }
    };
    if (!MpiThread::Get().Post(std::move(job)) && done) {
      done(Unavailable("MPI was finalized at process exit"));
    }
  }

  std::shared_ptr<CommState> state_;
  uint64_t enqueued_ = 0;  // Enqueueing thread.
};

}  // namespace

bool MpiAvailable() { return true; }

Result<std::unique_ptr<Communicator>> CreateMpiCommunicator(const MpiCommunicatorOptions& options) {
  if (!(options.timeout_seconds > 0) || !std::isfinite(options.timeout_seconds)) {
    return InvalidArgument("the collective timeout must be a number of seconds > 0");
  }
  MpiThread& thread = MpiThread::Get();
  STRATA_RETURN_IF_ERROR(thread.started());
  auto state = std::make_shared<CommState>();
  state->timeout_seconds = options.timeout_seconds;
  std::promise<Status> created;
  std::future<Status> result = created.get_future();
  const bool posted = thread.Post([state, &created] {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {
      created.set_value(Unavailable("MPI was finalized in this process"));
      return;
    }
    MPI_Request request = MPI_REQUEST_NULL;
    if (const int code = MPI_Comm_idup(MPI_COMM_WORLD, &state->comm, &request);
        code != MPI_SUCCESS) {
      created.set_value(Internal("MPI_Comm_idup: " + MpiErrorText(code)));
      return;
    }
    Status status =
        Await(request, state->timeout_seconds, "creating a communicator (MPI_Comm_idup)", nullptr);
    if (status.ok()) {
      MPI_Comm_set_errhandler(state->comm, MPI_ERRORS_RETURN);
      MPI_Comm_rank(state->comm, &state->rank);
      MPI_Comm_size(state->comm, &state->size);
      Types();
    } else {
      state->timed_out = true;
    }
    created.set_value(std::move(status));
  });
  if (!posted) return Unavailable("MPI was finalized at process exit");
  STRATA_RETURN_IF_ERROR(result.get());
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(std::move(state)));
}

#endif  // STRATA_WITH_MPI

}  // namespace strata::offload
