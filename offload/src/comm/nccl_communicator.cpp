// NcclCommunicator: see strata/offload/nccl_communicator.h. Built when CMake finds NCCL beside
// the CUDA toolkit; nccl_absent.cpp otherwise.
#include "strata/offload/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "comm/collective_peers.h"
#include "comm/collective_queue.h"
#include "comm/nccl_bootstrap.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point DeadlineAfter(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
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

/// One rank's NCCL communicator and its stream, used by the queue's thread one collective at
/// a time.
class NcclWire final : public internal::CollectiveWire {
 public:
  NcclWire(const NcclCommunicatorOptions& options, ncclComm_t comm, cudaStream_t stream,
           cudaEvent_t finished)
      : rank_(options.rank),
        size_(options.size),
        node_(options.node.value_or(NodePlace{options.rank, options.size})),
        device_(options.device_index),
        timeout_seconds_(options.timeout_seconds),
        comm_(comm),
        stream_(stream),
        finished_(finished) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  NodePlace node() const override { return node_; }

  Status Run(const internal::QueuedCollective& queued) override {
    name_ = queued.name;
    if (cudaSetDevice(device_) != cudaSuccess) {
      return Internal(name_ + ": cudaSetDevice(" + std::to_string(device_) + ")");
    }
    const Collective& c = queued.collective;
    switch (c.kind) {
      case Collective::Kind::kAllReduce: return AllReduce(c, NcclType(c.dtype));
      case Collective::Kind::kAllReduceScalars: return AllReduce(c, ncclFloat64);
      case Collective::Kind::kReduceScatter: return ReduceScatter(c);
      case Collective::Kind::kAllGather: return AllGather(c);
      case Collective::Kind::kAllToAll: return AllToAll(c);
    }
    return Internal(name_ + ": not a collective NCCL runs");
  }

  /// After the last collective: finalized and destroyed when nothing failed, aborted otherwise
  /// (`failed` includes an input that failed, after which the peers ran without this rank).
  void Close(const Status& failed) override {
    OnGpu(device_, [&] {
      if (!aborted_ && failed.ok()) {
        // Flushes what NCCL still has in flight; a peer gone by now makes it time out.
        const auto deadline = DeadlineAfter(timeout_seconds_);
        Settle(ncclCommFinalize(comm_), deadline, "finalizing").IgnoreError();
      }
      if (!aborted_ && failed.ok()) {
        ncclCommDestroy(comm_);
      } else if (!aborted_) {
        // A failed collective may have left peers (or this rank) inside one: abort, which
        // does not wait for them.
        ncclCommAbort(comm_);
        aborted_ = true;
      }
      // A kernel that outlived an abort may still write the scratch: then it stays.
      if (scratch_ != nullptr && failed.ok()) cudaFree(scratch_);
      cudaEventDestroy(finished_);
      cudaStreamDestroy(stream_);
      return 0;
    });
  }

 private:
  /// All-reduce in place, of tensors or (as `type` float64) step scalars.
  Status AllReduce(const Collective& c, ncclDataType_t type) {
    const size_t bytes = c.recv_bytes(size_);
    STRATA_RETURN_IF_ERROR(ReserveScratch(OnDevice(c.recv, device_) ? 0 : bytes));
    STRATA_ASSIGN_OR_RETURN(std::byte * buffer, Stage(c.recv, bytes, 0, /*in=*/true));
    const ncclResult_t launched =
        ncclAllReduce(buffer, buffer, c.count, type, NcclOp(c.op), comm_, stream_);
    return Finish(launched, buffer, c.recv, bytes);
  }

  Status ReduceScatter(const Collective& c) {
    const size_t recv_bytes = c.recv_bytes(size_);
    const size_t send_bytes = c.send_bytes(size_);
    const bool staged = !OnDevice(c.send, device_) || !OnDevice(c.recv, device_);
    STRATA_RETURN_IF_ERROR(ReserveScratch(staged ? send_bytes + recv_bytes : 0));
    STRATA_ASSIGN_OR_RETURN(std::byte * in, Stage(const_cast<void*>(c.send), send_bytes, 0, true));
    STRATA_ASSIGN_OR_RETURN(std::byte * out, Stage(c.recv, recv_bytes, send_bytes, false));
    const ncclResult_t launched =
        ncclReduceScatter(in, out, c.count, NcclType(c.dtype), NcclOp(c.op), comm_, stream_);
    return Finish(launched, out, c.recv, recv_bytes);
  }

  Status AllGather(const Collective& c) {
    const size_t send_bytes = c.send_bytes(size_);
    const size_t recv_bytes = c.recv_bytes(size_);
    STRATA_RETURN_IF_ERROR(ReserveScratch(OnDevice(c.recv, device_) ? 0 : recv_bytes));
    STRATA_ASSIGN_OR_RETURN(std::byte * out, Stage(c.recv, recv_bytes, 0, false));
    // This rank's slot of the output is its input: in place, as NCCL allows.
    std::byte* own = out + size_t(rank_) * send_bytes;
    if (OnDevice(c.send, device_) && OnDevice(c.recv, device_)) {
      if (c.send != own) {
        STRATA_CUDA_OK(cudaMemcpyAsync(own, c.send, send_bytes, cudaMemcpyDeviceToDevice, stream_),
                       "copying the all-gather's input");
      }
    } else {
      STRATA_CUDA_OK(cudaMemcpyAsync(own, c.send, send_bytes, cudaMemcpyDefault, stream_),
                     "copying the all-gather's input to the device");
    }
    const ncclResult_t launched =
        ncclAllGather(own, out, c.count, NcclType(c.dtype), comm_, stream_);
    return Finish(launched, out, c.recv, recv_bytes);
  }

  Status AllToAll(const Collective& c) {
    const size_t block = c.count * c.element_bytes();
    const size_t bytes = c.send_bytes(size_);
    const bool staged = !OnDevice(c.send, device_) || !OnDevice(c.recv, device_);
    STRATA_RETURN_IF_ERROR(ReserveScratch(staged ? 2 * bytes : 0));
    STRATA_ASSIGN_OR_RETURN(std::byte * in, Stage(const_cast<void*>(c.send), bytes, 0, true));
    STRATA_ASSIGN_OR_RETURN(std::byte * out, Stage(c.recv, bytes, bytes, false));
    // NCCL's all-to-all: one send and one receive per peer, in a group. A nonblocking
    // communicator reports the group's launch at ncclGroupEnd; the group is ended whatever
    // happened inside it.
    const ncclDataType_t type = NcclType(c.dtype);
    ncclResult_t launched = ncclGroupStart();
    for (int r = 0; r < size_ && (launched == ncclSuccess || launched == ncclInProgress); ++r) {
      launched = ncclSend(in + size_t(r) * block, c.count, type, r, comm_, stream_);
      if (launched == ncclSuccess || launched == ncclInProgress) {
        launched = ncclRecv(out + size_t(r) * block, c.count, type, r, comm_, stream_);
      }
    }
    const ncclResult_t ended = ncclGroupEnd();
    const bool inside_ok = launched == ncclSuccess || launched == ncclInProgress;
    return Finish(inside_ok ? ended : launched, out, c.recv, bytes);
  }

  /// Scratch of at least `bytes` for a collective's host buffers, before any is staged (growing
  /// it later would drop what was staged). The queue's thread, between collectives: the
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
  /// scratch at `offset` (copied in first when `in`). The queue's thread, after
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
    return internal::DidNotComplete(what, timeout_seconds_,
                                    internal::PeersStopped(internal::PeersOf(rank_, size_),
                                                           "placement.collective_timeout_seconds"));
  }

  /// Aborts the communicator (once) and returns `error`. The queue's thread.
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
  const NodePlace node_;
  const int device_;
  const double timeout_seconds_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  cudaEvent_t finished_;

  // The queue's thread only.
  bool aborted_ = false;
  std::string name_;  // The collective running.
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
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
    return internal::DidNotComplete(what, timeout_seconds,
                                    "not every rank joined (placement.collective_timeout_seconds)");
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
  return internal::MakeQueuedCommunicator(
      std::make_unique<NcclWire>(options, comm, stream, finished));
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
  if (options.node) {
    STRATA_RETURN_IF_ERROR(
        internal::CheckNodePlace(*options.node, options.size, "NcclCommunicatorOptions::node"));
  }
  // The caller's current GPU stays current on its thread.
  return OnGpu(options.device_index, [&] { return Create(options); });
}

}  // namespace strata::offload
