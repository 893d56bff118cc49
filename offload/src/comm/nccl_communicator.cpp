// NcclCommunicator: see strata/offload/nccl_communicator.h. Built when CMake finds NCCL beside
// the CUDA toolkit; nccl_absent.cpp otherwise.
#include "strata/offload/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "comm/collective_peers.h"
#include "comm/nccl_bootstrap.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point DeadlineAfter(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

std::string Seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", seconds);
  return text;
}

Status CudaFailed(cudaError_t error, const std::string& what) {
  return Internal(what + ": " + cudaGetErrorString(error));
}

#define STRATA_CUDA_OK(expr, what)                                            \
  do {                                                                        \
    const cudaError_t strata_error_ = (expr);                                 \
    if (strata_error_ != cudaSuccess) return CudaFailed(strata_error_, what); \
  } while (0)

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return ncclFloat32;
    case DType::kBf16: return ncclBfloat16;
    case DType::kFp16: return ncclFloat16;
  }
  return ncclFloat32;
}

ncclRedOp_t NcclOp(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

/// Whether `pointer` is memory of GPU `device` that NCCL may use in place (device or managed
/// memory); host memory (pinned or not) and other GPUs' memory go through scratch.
bool OnDevice(const void* pointer, int device) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();  // Clear the error it leaves.
    return false;
  }
  return (attributes.type == cudaMemoryTypeDevice && attributes.device == device) ||
         attributes.type == cudaMemoryTypeManaged;
}

/// Runs `function` with GPU `device` current on this thread, then puts the caller's back.
template <typename Function>
auto OnGpu(int device, Function function) {
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  auto result = function();
  if (previous >= 0) cudaSetDevice(previous);
  return result;
}

/// One rank's NCCL communicator, its stream and the thread that runs its collectives in order.
class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclCommunicatorOptions& options, ncclComm_t comm, cudaStream_t stream,
                   cudaEvent_t finished)
      : rank_(options.rank),
        size_(options.size),
        device_(options.device_index),
        timeout_seconds_(options.timeout_seconds),
        comm_(comm),
        stream_(stream),
        finished_(finished),
        thread_([this] { Main(); }) {}

  ~NcclCommunicator() override {
    if (std::this_thread::get_id() == thread_.get_id()) {
      // From a collective's own callback: the thread cannot join itself.
      std::fprintf(stderr, "strata: an NCCL communicator was destroyed from its own callback\n");
      std::abort();
    }
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      wake_.notify_one();
    }
    thread_.join();  // Runs (or fails) every collective enqueued first.
    OnGpu(device_, [this] {
      if (!aborted_ && failed_.ok()) {
        // Flushes what NCCL still has in flight; a peer gone by now makes it time out.
        const auto deadline = DeadlineAfter(timeout_seconds_);
        Settle(ncclCommFinalize(comm_), deadline, "finalizing").IgnoreError();
      }
      if (!aborted_ && failed_.ok()) {
        ncclCommDestroy(comm_);
      } else if (!aborted_) {
        // A failed collective may have left peers (or this rank) inside one: abort, which
        // does not wait for them.
        ncclCommAbort(comm_);
        aborted_ = true;
      }
      // A kernel that outlived an abort may still write the scratch: then it stays.
      if (scratch_ != nullptr && failed_.ok()) cudaFree(scratch_);
      cudaEventDestroy(finished_);
      cudaStreamDestroy(stream_);
      return 0;
    });
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void AllReduce(void* data, size_t count, DType dtype, ReduceOp op, CollectiveReady ready,
                 CollectiveDone done) override {
    const size_t bytes = count * DTypeSize(dtype);
    Enqueue("all-reduce of " + std::to_string(count) + " elements", std::move(ready),
            std::move(done), [=, this]() -> Status {
              STRATA_RETURN_IF_ERROR(ReserveScratch(OnDevice(data, device_) ? 0 : bytes));
              STRATA_ASSIGN_OR_RETURN(std::byte * buffer, Stage(data, bytes, 0, /*in=*/true));
              const ncclResult_t launched =
                  ncclAllReduce(buffer, buffer, count, NcclType(dtype), NcclOp(op), comm_, stream_);
              return Finish(launched, buffer, data, bytes);
            });
  }

  void ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op,
                     CollectiveReady ready, CollectiveDone done) override {
    const size_t recv_bytes = recv_count * DTypeSize(dtype);
    const size_t send_bytes = recv_bytes * size_t(size_);
    Enqueue("reduce-scatter of " + std::to_string(recv_count) + " elements per rank",
            std::move(ready), std::move(done), [=, this]() -> Status {
              const bool staged = !OnDevice(send, device_) || !OnDevice(recv, device_);
              STRATA_RETURN_IF_ERROR(ReserveScratch(staged ? send_bytes + recv_bytes : 0));
              STRATA_ASSIGN_OR_RETURN(std::byte * in,
                                      Stage(const_cast<void*>(send), send_bytes, 0, true));
              STRATA_ASSIGN_OR_RETURN(std::byte * out, Stage(recv, recv_bytes, send_bytes, false));
              const ncclResult_t launched = ncclReduceScatter(in, out, recv_count, NcclType(dtype),
                                                              NcclOp(op), comm_, stream_);
              return Finish(launched, out, recv, recv_bytes);
            });
  }

  void AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                 CollectiveReady ready, CollectiveDone done) override {
    const size_t send_bytes = send_count * DTypeSize(dtype);
    const size_t recv_bytes = send_bytes * size_t(size_);
    Enqueue("all-gather of " + std::to_string(send_count) + " elements per rank", std::move(ready),
            std::move(done), [=, this]() -> Status {
              STRATA_RETURN_IF_ERROR(ReserveScratch(OnDevice(recv, device_) ? 0 : recv_bytes));
              STRATA_ASSIGN_OR_RETURN(std::byte * out, Stage(recv, recv_bytes, 0, false));
              // This rank's slot of the output is its input: in place, as NCCL allows.
              std::byte* own = out + size_t(rank_) * send_bytes;
              if (OnDevice(send, device_) && OnDevice(recv, device_)) {
                if (send != own) {
                  STRATA_CUDA_OK(
                      cudaMemcpyAsync(own, send, send_bytes, cudaMemcpyDeviceToDevice, stream_),
                      "copying the all-gather's input");
                }
              } else {
                STRATA_CUDA_OK(cudaMemcpyAsync(own, send, send_bytes, cudaMemcpyDefault, stream_),
                               "copying the all-gather's input to the device");
              }
              const ncclResult_t launched =
                  ncclAllGather(own, out, send_count, NcclType(dtype), comm_, stream_);
              return Finish(launched, out, recv, recv_bytes);
            });
  }

  void AllToAll(const void* send, void* recv, size_t count, DType dtype, CollectiveReady ready,
                CollectiveDone done) override {
    const size_t block = count * DTypeSize(dtype);
    const size_t bytes = block * size_t(size_);
    Enqueue(
        "all-to-all of " + std::to_string(count) + " elements per rank", std::move(ready),
        std::move(done), [=, this]() -> Status {
          const bool staged = !OnDevice(send, device_) || !OnDevice(recv, device_);
          STRATA_RETURN_IF_ERROR(ReserveScratch(staged ? 2 * bytes : 0));
          STRATA_ASSIGN_OR_RETURN(std::byte * in, Stage(const_cast<void*>(send), bytes, 0, true));
          STRATA_ASSIGN_OR_RETURN(std::byte * out, Stage(recv, bytes, bytes, false));
          // NCCL's all-to-all: one send and one receive per peer, in a group. A nonblocking
          // communicator reports the group's launch at ncclGroupEnd; the group is ended
          // whatever happened inside it.
          ncclResult_t launched = ncclGroupStart();
          for (int r = 0; r < size_ && (launched == ncclSuccess || launched == ncclInProgress);
               ++r) {
            launched = ncclSend(in + size_t(r) * block, count, NcclType(dtype), r, comm_, stream_);
            if (launched == ncclSuccess || launched == ncclInProgress) {
              launched =
                  ncclRecv(out + size_t(r) * block, count, NcclType(dtype), r, comm_, stream_);
            }
          }
          const ncclResult_t ended = ncclGroupEnd();
          const bool inside_ok = launched == ncclSuccess || launched == ncclInProgress;
          return Finish(inside_ok ? ended : launched, out, recv, bytes);
        });
  }

  void AllReduceScalars(std::span<double> values, ReduceOp op, CollectiveReady ready,
                        CollectiveDone done) override {
    const size_t bytes = values.size() * sizeof(double);
    Enqueue(
        "all-reduce of " + std::to_string(values.size()) + " step scalars", std::move(ready),
        std::move(done), [=, this]() -> Status {
          STRATA_RETURN_IF_ERROR(ReserveScratch(bytes));
          STRATA_ASSIGN_OR_RETURN(std::byte * buffer, Stage(values.data(), bytes, 0, /*in=*/true));
          const ncclResult_t launched =
              ncclAllReduce(buffer, buffer, values.size(), ncclFloat64, NcclOp(op), comm_, stream_);
          return Finish(launched, buffer, values.data(), bytes);
        });
  }

 private:
  struct Job {
    std::string what;
    CollectiveReady ready;
    CollectiveDone done;
    std::function<Status()> run;
  };

  void Enqueue(std::string what, CollectiveReady ready, CollectiveDone done,
               std::function<Status()> run) {
    std::lock_guard lock(mutex_);
    const std::string name = "rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
                             ": collective #" + std::to_string(++enqueued_) + " (" + what + ")";
    jobs_.push_back({name, std::move(ready), std::move(done), std::move(run)});
    wake_.notify_one();
  }

  void Main() {
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      Status status = failed_;
      if (status.ok() && job.ready) {
        try {
          status = job.ready();
        } catch (const std::exception& e) {
          status = Internal(job.what + ": its ready function threw: " + e.what());
        }
      }
      if (status.ok()) {
        name_ = job.what;
        status = cudaSetDevice(device_) == cudaSuccess
                     ? job.run()
                     : Internal(job.what + ": cudaSetDevice(" + std::to_string(device_) + ")");
      }
      // A failed collective (or input, which the peers ran without this rank) fails every
      // later one, as Communicator says.
      if (!status.ok() && failed_.ok()) failed_ = status;
      if (!job.done) continue;
      try {
        job.done(std::move(status));
      } catch (...) {
        // Nothing to tell: the callback's own failure is its owner's to report.
      }
    }
  }

  /// Scratch of at least `bytes` for a collective's host buffers, before any is staged (growing
  /// it later would drop what was staged). Communicator thread, between collectives: the
  /// stream is idle (each collective waits for its end).
  Status ReserveScratch(size_t bytes) {
    if (bytes <= scratch_bytes_) return Status();
    if (scratch_ != nullptr) cudaFree(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    STRATA_CUDA_OK(cudaMalloc(&scratch_, bytes), "allocating NCCL scratch memory");
    scratch_bytes_ = bytes;
    return Status();
  }

  /// Where NCCL reads or writes `bytes` of `buffer`: the buffer itself in GPU memory, else
  /// scratch at `offset` (copied in first when `in`). Communicator thread, after
  /// ReserveScratch.
  Result<std::byte*> Stage(void* buffer, size_t bytes, size_t offset, bool in) {
    if (OnDevice(buffer, device_)) return static_cast<std::byte*>(buffer);
    if (offset + bytes > scratch_bytes_) return Internal(name_ + ": NCCL scratch too small");
    std::byte* staged = static_cast<std::byte*>(scratch_) + offset;
    if (in) {
      STRATA_CUDA_OK(cudaMemcpyAsync(staged, buffer, bytes, cudaMemcpyDefault, stream_),
                     "copying a collective's input to the device");
    }
    return staged;
  }

  /// After the launch: waits until the collective is done, an NCCL error, or the timeout
  /// (any failure aborts the communicator, which ends kernels waiting for a missing rank), then
  /// copies `result` back to `buffer` when it was staged. The copy back comes only after the
  /// collective completed: one queued behind it into pageable memory would block this thread
  /// past the timeout, and one left queued by a failure would write `buffer` after `done`.
  Status Finish(ncclResult_t launched, const std::byte* result, void* buffer, size_t bytes) {
    const auto deadline = DeadlineAfter(timeout_seconds_);
    STRATA_RETURN_IF_ERROR(Settle(launched, deadline, name_));  // On the stream now.
    if (cudaError_t recorded = cudaEventRecord(finished_, stream_); recorded != cudaSuccess) {
      return Abort(CudaFailed(recorded, name_ + ": recording its end"));
    }
    auto pause = std::chrono::microseconds(0);
    for (;;) {
      const cudaError_t query = cudaEventQuery(finished_);
      if (query == cudaSuccess) break;
      if (query != cudaErrorNotReady) return Abort(CudaFailed(query, name_));
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        return Abort(Internal(name_ + ": " + ncclGetErrorString(async)));
      }
      if (Clock::now() > deadline) return Abort(TimedOut(name_));
      if (pause.count() > 0) std::this_thread::sleep_for(pause);
      pause = std::min(std::chrono::microseconds(1000), pause + std::chrono::microseconds(20));
    }
    if (result != buffer) {
      STRATA_CUDA_OK(cudaMemcpy(buffer, result, bytes, cudaMemcpyDefault),
                     name_ + ": copying the result back");
    }
    return Status();
  }

  /// Waits for an NCCL call on the nonblocking communicator that returned ncclInProgress until
  /// it is through, an error, or `deadline`; a failure aborts the communicator.
  Status Settle(ncclResult_t result, Clock::time_point deadline, const std::string& what) {
    while (result == ncclInProgress) {
      if (Clock::now() > deadline) return Abort(TimedOut(what));
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      ncclCommGetAsyncError(comm_, &result);
    }
    if (result != ncclSuccess) return Abort(Internal(what + ": " + ncclGetErrorString(result)));
    return Status();
  }

  Status TimedOut(const std::string& what) const {
    return Unavailable(what + " did not complete within " + Seconds(timeout_seconds_) + ": " +
                       internal::PeersOf(rank_, size_) +
                       " died, hangs or stopped enqueueing the same collectives "
                       "(placement.collective_timeout_seconds)");
  }

  /// Aborts the communicator (once) and returns `error`. Communicator thread, or the
  /// destructor after it.
  Status Abort(Status error) {
    if (!aborted_) {
      ncclCommAbort(comm_);
      aborted_ = true;
      // What the stream still holds (a staging copy) may run once the kernels have ended.
      const auto grace = Clock::now() + std::chrono::seconds(10);
      while (cudaStreamQuery(stream_) == cudaErrorNotReady && Clock::now() < grace) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    return error;
  }

  const int rank_;
  const int size_;
  const int device_;
  const double timeout_seconds_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  cudaEvent_t finished_;

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  uint64_t enqueued_ = 0;

  // Communicator thread only.
  Status failed_;
  bool aborted_ = false;
  std::string name_;  // The collective running.
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;

  std::thread thread_;  // Last: starts once everything above exists.
};

/// Waits for the nonblocking ncclCommInitRankConfig until every rank joined, an error or
/// `deadline`; a failure aborts the half-made communicator (its threads and memory go).
Status SettleInit(ncclComm_t comm, ncclResult_t result, Clock::time_point deadline,
                  const std::string& what, double timeout_seconds) {
  while (result == ncclInProgress && Clock::now() <= deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ncclCommGetAsyncError(comm, &result);
  }
  if (result == ncclSuccess) return Status();
  if (comm != nullptr) ncclCommAbort(comm);
  if (result == ncclInProgress) {
    return Unavailable(what + " did not complete within " + Seconds(timeout_seconds) +
                       ": not every rank joined (placement.collective_timeout_seconds)");
  }
  return Internal(what + ": " + ncclGetErrorString(result));
}

Result<std::unique_ptr<Communicator>> Create(const NcclCommunicatorOptions& options) {
  const std::string rank =
      "rank " + std::to_string(options.rank) + " of " + std::to_string(options.size) + ": ";
  if (cudaSetDevice(options.device_index) != cudaSuccess) {
    return Unavailable(rank + "cannot use GPU " + std::to_string(options.device_index) + ": " +
                       cudaGetErrorString(cudaGetLastError()));
  }
  ncclUniqueId id{};
  if (options.rank == 0) {
    if (const ncclResult_t made = ncclGetUniqueId(&id); made != ncclSuccess) {
      return Internal(rank + "ncclGetUniqueId: " + ncclGetErrorString(made));
    }
  }
  if (options.size > 1) {
    const auto* bytes = reinterpret_cast<const std::byte*>(&id);
    STRATA_ASSIGN_OR_RETURN(
        std::vector<std::byte> shared,
        internal::ShareFromRankZero({.rank = options.rank,
                                     .bootstrap = options.bootstrap,
                                     .file = options.id_file,
                                     .timeout_seconds = options.timeout_seconds},
                                    {bytes, sizeof id}));
    std::memcpy(&id, shared.data(), sizeof id);
  }
  // Nonblocking, so that a rank that never joins is a timeout rather than a hang.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const auto deadline = DeadlineAfter(options.timeout_seconds);
  const ncclResult_t started =
      ncclCommInitRankConfig(&comm, options.size, id, options.rank, &config);
  STRATA_RETURN_IF_ERROR(SettleInit(
      comm, started, deadline, rank + "creating the NCCL communicator", options.timeout_seconds));
  // Every rank has joined, so every rank has read the id: a file of it goes, and cannot be
  // taken for the next job's.
  if (options.rank == 0 && options.bootstrap == nullptr && !options.id_file.empty()) {
    std::error_code ignored;
    std::filesystem::remove(options.id_file, ignored);
  }
  cudaStream_t stream = nullptr;
  cudaEvent_t finished = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreateWithFlags(&finished, cudaEventDisableTiming) != cudaSuccess) {
    const cudaError_t error = cudaGetLastError();
    if (stream != nullptr) cudaStreamDestroy(stream);
    ncclCommAbort(comm);
    return CudaFailed(error, rank + "creating the NCCL stream");
  }
  return std::unique_ptr<Communicator>(
      std::make_unique<NcclCommunicator>(options, comm, stream, finished));
}

}  // namespace

bool NcclAvailable() { return true; }

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    const NcclCommunicatorOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return InvalidArgument("NCCL rank " + std::to_string(options.rank) + " of " +
                           std::to_string(options.size) + " is out of range");
  }
  if (!(options.timeout_seconds > 0)) {
    return InvalidArgument("the collective timeout must be a number of seconds > 0");
  }
  // The caller's current GPU stays current on its thread.
  return OnGpu(options.device_index, [&] { return Create(options); });
}

}  // namespace strata::offload
