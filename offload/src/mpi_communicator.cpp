#include "strata/offload/mpi_communicator.h"

#include <cmath>
#include <string>

#if STRATA_WITH_MPI
#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
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
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return "MPI error " + std::to_string(code);
  return std::string(text, size_t(length));
}

/// The one thread of the process that calls MPI. It initializes MPI when it starts, unless the
/// trainer did, and finalizes it at process exit — unless a collective that timed out is still
/// not complete a few seconds later (its peer is dead): then it leaves MPI as it is, so that the
/// process exits and mpirun takes the job down instead of every rank hanging in MPI_Finalize.
class MpiThread {
 public:
  static MpiThread& Get() {
    static MpiThread thread;
    return thread;
  }

  /// How starting MPI went.
  const Status& started() const { return started_; }

  /// Runs `job` on the MPI thread after every job posted before it.
  void Post(std::function<void()> job) {
    std::lock_guard lock(mutex_);
    jobs_.push_back(std::move(job));
    wake_.notify_one();
  }

  /// Runs `job` there and waits for its result.
  template <typename T>
  T Call(std::function<T()> job) {
    std::packaged_task<T()> task(std::move(job));
    std::future<T> result = task.get_future();
    Post([&task] { task(); });
    return result.get();
  }

  /// A collective that timed out: MPI is finalized only if it completes after all. MPI thread.
  void Abandon(MPI_Request request) { abandoned_.push_back(request); }

 private:
  MpiThread() {
    std::promise<Status> started;
    std::future<Status> result = started.get_future();
    thread_ = std::thread([this, started = std::move(started)]() mutable { Main(started); });
    started_ = result.get();
  }

  ~MpiThread() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      wake_.notify_one();
    }
    thread_.join();
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
      const int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      owner = code == MPI_SUCCESS;
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
    if (owner && AbandonedComplete()) MPI_Finalize();
  }

  /// Whether every abandoned collective completed, given a grace period for late peers.
  bool AbandonedComplete() {
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    for (MPI_Request& request : abandoned_) {
      int finished = 0;
      while (MPI_Test(&request, &finished, MPI_STATUS_IGNORE) == MPI_SUCCESS && !finished) {
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
  std::vector<MPI_Request> abandoned_;  // MPI thread only.
  Status started_;
  std::thread thread_;
};

/// Element-wise reductions of 16-bit floats, which MPI has no type for: each pair is reduced
/// in fp32 and rounded back once.
template <float (*ToFp32)(uint16_t), uint16_t (*FromFp32)(float), bool kMax>
void Reduce16(void* in, void* inout, int* length, MPI_Datatype* /*type*/) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *length; ++i) {
    const float x = ToFp32(a[i]), y = ToFp32(b[i]);
    b[i] = FromFp32(kMax ? std::fmax(x, y) : x + y);
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

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, int rank, int size, double timeout_seconds)
      : comm_(comm), rank_(rank), size_(size), timeout_seconds_(timeout_seconds) {}

  ~MpiCommunicator() override {
    // Behind every collective enqueued: they run (or fail) first. A communicator with a
    // collective that timed out stays: MPI may still complete it, and freeing its
    // communicator under it crashes MPI's progress engine.
    MpiThread::Get().Call<int>([this] {
      MPI_Comm comm = comm_;
      return timed_out_ ? MPI_SUCCESS : MPI_Comm_free(&comm);
    });
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void AllReduce(void* data, size_t count, DType dtype, ReduceOp op, CollectiveReady ready,
                 CollectiveDone done) override {
    Enqueue("all-reduce of " + std::to_string(count) + " elements", std::move(ready),
            std::move(done), [=, this](MPI_Request* request) {
              return MPI_Iallreduce(MPI_IN_PLACE, data, int(count), Types().Type(dtype),
                                    Types().Op(dtype, op), comm_, request);
            });
  }

  void ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op,
                     CollectiveReady ready, CollectiveDone done) override {
    Enqueue("reduce-scatter of " + std::to_string(recv_count) + " elements per rank",
            std::move(ready), std::move(done), [=, this](MPI_Request* request) {
              return MPI_Ireduce_scatter_block(send, recv, int(recv_count), Types().Type(dtype),
                                               Types().Op(dtype, op), comm_, request);
            });
  }

  void AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                 CollectiveReady ready, CollectiveDone done) override {
    Enqueue("all-gather of " + std::to_string(send_count) + " elements per rank", std::move(ready),
            std::move(done), [=, this](MPI_Request* request) {
              return MPI_Iallgather(send, int(send_count), Types().Type(dtype), recv,
                                    int(send_count), Types().Type(dtype), comm_, request);
            });
  }

  void AllReduceScalars(std::span<double> values, ReduceOp op, CollectiveReady ready,
                        CollectiveDone done) override {
    Enqueue("all-reduce of " + std::to_string(values.size()) + " step scalars", std::move(ready),
            std::move(done), [=, this](MPI_Request* request) {
              return MPI_Iallreduce(MPI_IN_PLACE, values.data(), int(values.size()), MPI_DOUBLE,
                                    op == ReduceOp::kSum ? MPI_SUM : MPI_MAX, comm_, request);
            });
  }

 private:
  using Start = std::function<int(MPI_Request*)>;

  void Enqueue(std::string what, CollectiveReady ready, CollectiveDone done, Start start) {
    const uint64_t number = ++enqueued_;
    MpiThread::Get().Post([this, number, what = std::move(what), ready = std::move(ready),
                           done = std::move(done), start = std::move(start)] {
      Status status = failed_;
      if (status.ok() && ready) status = ready();
      if (status.ok()) status = Run(number, what, start);
      if (!status.ok() && failed_.ok()) failed_ = status;
      if (done) done(std::move(status));
    });
  }

  /// Starts one collective and polls it to completion or to the timeout. MPI thread.
  Status Run(uint64_t number, const std::string& what, const Start& start) {
    const std::string name = "rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
                             ": collective #" + std::to_string(number) + " (" + what + ")";
    MPI_Request request = MPI_REQUEST_NULL;
    if (const int code = start(&request); code != MPI_SUCCESS) {
      return Internal(name + " could not start: " + MpiErrorText(code));
    }
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds_);
    auto pause = std::chrono::microseconds(0);
    for (;;) {
      int finished = 0;
      if (const int code = MPI_Test(&request, &finished, MPI_STATUS_IGNORE); code != MPI_SUCCESS) {
        return Internal(name + " failed: " + MpiErrorText(code));
      }
      if (finished) return Status();
      if (Clock::now() > deadline) {
        MpiThread::Get().Abandon(request);
        timed_out_ = true;
        return Unavailable(name + " did not complete within " +
                           std::to_string(int(std::ceil(timeout_seconds_))) +
                           " s: another rank died or stopped enqueueing the same collectives "
                           "(MpiCommunicatorOptions::timeout_seconds)");
      }
      // Short collectives finish within the first polls; long ones cost a few microseconds
      // of latency at most 1 ms apart.
      if (pause.count() > 0) std::this_thread::sleep_for(pause);
      pause = std::min(std::chrono::microseconds(1000),
                       pause + std::chrono::microseconds(pause.count() < 50 ? 5 : 50));
    }
  }

  const MPI_Comm comm_;
  const int rank_;
  const int size_;
  const double timeout_seconds_;
  uint64_t enqueued_ = 0;  // Enqueueing thread.
  // MPI thread only: the first failure, which every later collective reports, and whether a
  // collective timed out.
  Status failed_;
  bool timed_out_ = false;
};

}  // namespace

bool MpiAvailable() { return true; }

Result<std::unique_ptr<Communicator>> CreateMpiCommunicator(const MpiCommunicatorOptions& options) {
  if (!(options.timeout_seconds > 0) || !std::isfinite(options.timeout_seconds)) {
    return InvalidArgument("the collective timeout must be a number of seconds > 0");
  }
  MpiThread& thread = MpiThread::Get();
  STRATA_RETURN_IF_ERROR(thread.started());
  struct World {
    int code = MPI_SUCCESS;
    MPI_Comm comm = MPI_COMM_NULL;
    int rank = 0, size = 1;
  };
  const World world = thread.Call<World>([] {
    World w;
    w.code = MPI_Comm_dup(MPI_COMM_WORLD, &w.comm);
    if (w.code == MPI_SUCCESS) {
      MPI_Comm_set_errhandler(w.comm, MPI_ERRORS_RETURN);
      MPI_Comm_rank(w.comm, &w.rank);
      MPI_Comm_size(w.comm, &w.size);
      Types();
    }
    return w;
  });
  if (world.code != MPI_SUCCESS) return Internal("MPI_Comm_dup: " + MpiErrorText(world.code));
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(
      world.comm, world.rank, world.size, options.timeout_seconds));
}

#endif  // STRATA_WITH_MPI

}  // namespace strata::offload
