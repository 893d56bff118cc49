#include "strata/offload/mpi_communicator.h"

#include <cmath>
#include <string>

#if STRATA_WITH_MPI
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <future>
#include <limits>
#include <thread>
#include <vector>

#include "comm/collective_peers.h"
#include "comm/collective_queue.h"
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

/// The one thread of the process that calls MPI, shared by every communicator: it runs their
/// jobs one at a time in the order posted. It initializes MPI when it starts (for every thread,
/// MPI_THREAD_MULTIPLE), unless the trainer did, and finalizes it at process exit (an atexit
/// handler; the object itself is never destroyed, so a communicator that outlives the handler
/// finds it stopped rather than freed) — unless the trainer finalized MPI already, or a
/// collective that timed out is still not complete a few seconds later (its peer is dead): then
/// it leaves MPI as it is, so the process exits and mpirun takes the job down instead of every
/// rank hanging in MPI_Finalize.
class MpiThread final : public internal::Executor {
 public:
  static MpiThread& Get() {
    static MpiThread* const thread = [] {
      auto* created = new MpiThread;
      std::atexit([] { Get().thread_.Stop(); });
      return created;
    }();
    return *thread;
  }

  /// How starting MPI went.
  const Status& started() const { return started_; }
  bool on_thread() const override { return thread_.on_thread(); }

  /// Runs `job` on the MPI thread after every job posted before it; Unavailable (and `job`
  /// dropped) once the thread stopped at exit.
  Status Post(std::function<void()> job) override { return thread_.Post(std::move(job)); }

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

  MpiThread()
      : thread_([this] { Start(); }, [this] { Finish(); }, "MPI was finalized at process exit") {
    started_ = started_future_.get();
  }

  /// On the MPI thread, before any job.
  void Start() {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized) {
      started_promise_.set_value(Unavailable("MPI was already finalized in this process"));
    } else if (initialized) {
      int provided = MPI_THREAD_SINGLE;
      MPI_Query_thread(&provided);
      started_promise_.set_value(
          provided >= MPI_THREAD_MULTIPLE
              ? Status()
              : Unavailable("MPI was initialized by the trainer without "
                            "MPI_THREAD_MULTIPLE; Strata calls MPI from a thread "
                            "of its own, so initialize it with that level"));
    } else {
      int provided = MPI_THREAD_SINGLE;
      const int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      owner_ = code == MPI_SUCCESS;
      // Below MULTIPLE, only this thread may call MPI: enough for Strata, which says so.
      started_promise_.set_value(owner_ ? Status()
                                        : Internal("MPI_Init_thread: " + MpiErrorText(code)));
    }
  }

  /// On the MPI thread, after the last job.
  void Finish() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owner_ && !finalized && AbandonedComplete()) MPI_Finalize();
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

  // MPI thread only (the promise until it is set).
  std::promise<Status> started_promise_;
  std::future<Status> started_future_ = started_promise_.get_future();
  bool owner_ = false;  // Whether Strata initialized MPI, and so finalizes it.
  std::vector<Abandoned> abandoned_;
  Status started_;
  internal::WorkerThread thread_;  // Last: starts once everything it uses exists.
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
      return internal::DidNotComplete(
          name, timeout_seconds,
          internal::PeersStopped(peers, "MpiCommunicatorOptions::timeout_seconds"));
    }
    // Short collectives finish within the first polls; long ones are polled at most 1 ms
    // apart.
    if (pause.count() > 0) std::this_thread::sleep_for(pause);
    pause = std::min(std::chrono::microseconds(1000),
                     pause + std::chrono::microseconds(pause.count() < 50 ? 5 : 50));
  }
}

/// What creating a communicator makes, on the MPI thread.
struct CommState {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
};

/// One communicator's wire: a duplicate of MPI_COMM_WORLD of its own, used on the MPI thread.
class MpiWire final : public internal::CollectiveWire {
 public:
  MpiWire(const CommState& made, const MpiCommunicatorOptions& options)
      : comm_(made.comm),
        rank_(made.rank),
        size_(made.size),
        node_(options.node.value_or(NodePlace{made.rank, made.size})),
        timeout_seconds_(options.timeout_seconds) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  NodePlace node() const override { return node_; }

  /// MPI counts are ints: refused alike on every rank, before any MPI call.
  Status Admit(const internal::QueuedCollective& queued) override {
    if (queued.collective.largest_count(size_) > size_t(std::numeric_limits<int>::max())) {
      return InvalidArgument(queued.name + " is larger than MPI's int counts allow");
    }
    return Status();
  }

  Status Run(const internal::QueuedCollective& queued) override {
    const Collective& c = queued.collective;
    const int count = int(c.count);
    const MPI_Datatype type = Types().Type(c.dtype);
    // Step scalars go through a copy the job owns, copied back on success: a collective that
    // times out may complete later, and the caller's span (a local, often) is gone by then.
    std::shared_ptr<std::vector<double>> copy;
    MPI_Request request = MPI_REQUEST_NULL;
    int code = MPI_SUCCESS;
    switch (c.kind) {
      case Collective::Kind::kAllReduce:
        code = MPI_Iallreduce(MPI_IN_PLACE, c.recv, count, type, Types().Op(c.dtype, c.op), comm_,
                              &request);
        break;
      case Collective::Kind::kReduceScatter:
        code = MPI_Ireduce_scatter_block(c.send, c.recv, count, type, Types().Op(c.dtype, c.op),
                                         comm_, &request);
        break;
      case Collective::Kind::kAllGather: {
        // MPI forbids overlapping buffers; its own slot of recv is MPI_IN_PLACE.
        const bool in_place =
            c.send == static_cast<const std::byte*>(c.recv) + size_t(rank_) * c.send_bytes(size_);
        code = MPI_Iallgather(in_place ? MPI_IN_PLACE : c.send, count, type, c.recv, count, type,
                              comm_, &request);
        break;
      }
      case Collective::Kind::kAllToAll:
        code = MPI_Ialltoall(c.send, count, type, c.recv, count, type, comm_, &request);
        break;
      case Collective::Kind::kAllReduceScalars: {
        const auto* values = static_cast<const double*>(c.send);
        copy = std::make_shared<std::vector<double>>(values, values + c.count);
        code = MPI_Iallreduce(MPI_IN_PLACE, copy->data(), count, MPI_DOUBLE,
                              c.op == ReduceOp::kSum ? MPI_SUM : MPI_MAX, comm_, &request);
        break;
      }
    }
    if (code != MPI_SUCCESS)
      return Internal(queued.name + " could not start: " + MpiErrorText(code));
    Status status =
        Await(request, timeout_seconds_, queued.name, copy, internal::PeersOf(rank_, size_));
    if (status.code() == StatusCode::kUnavailable) timed_out_ = true;
    if (status.ok() && copy) std::copy(copy->begin(), copy->end(), static_cast<double*>(c.recv));
    return status;
  }

  /// After the last collective. A communicator under a collective that timed out stays:
  /// freeing it under a request MPI may still complete crashes its progress engine.
  void Close(const Status& /*failed*/) override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !timed_out_) MPI_Comm_free(&comm_);
  }

 private:
  MPI_Comm comm_;
  const int rank_;
  const int size_;
  const NodePlace node_;
  const double timeout_seconds_;
  bool timed_out_ = false;  // MPI thread.
};

}  // namespace

bool MpiAvailable() { return true; }

Result<std::unique_ptr<Communicator>> CreateMpiCommunicator(const MpiCommunicatorOptions& options) {
  if (!(options.timeout_seconds > 0) || !std::isfinite(options.timeout_seconds)) {
    return InvalidArgument("the collective timeout must be a number of seconds > 0");
  }
  if (options.node) {
    // Checked before MPI says the size: a launcher that disagrees with MPI about the size is
    // the caller's to name (tools' ConnectLaunchedRanks does).
    STRATA_RETURN_IF_ERROR(internal::CheckNodePlace(*options.node, std::numeric_limits<int>::max(),
                                                    "MpiCommunicatorOptions::node"));
  }
  MpiThread& thread = MpiThread::Get();
  STRATA_RETURN_IF_ERROR(thread.started());
  auto state = std::make_shared<CommState>();
  std::promise<Status> created;
  std::future<Status> result = created.get_future();
  const Status posted = thread.Post([state, &created, timeout = options.timeout_seconds] {
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
    // One that times out is never freed (MPI may still complete it).
    Status status = Await(request, timeout, "creating a communicator (MPI_Comm_idup)", nullptr);
    if (status.ok()) {
      MPI_Comm_set_errhandler(state->comm, MPI_ERRORS_RETURN);
      MPI_Comm_rank(state->comm, &state->rank);
      MPI_Comm_size(state->comm, &state->size);
      Types();
    }
    created.set_value(std::move(status));
  });
  STRATA_RETURN_IF_ERROR(posted);
  STRATA_RETURN_IF_ERROR(result.get());
  return internal::MakeQueuedCommunicator(std::make_unique<MpiWire>(*state, options), thread);
}

#endif  // STRATA_WITH_MPI

}  // namespace strata::offload
