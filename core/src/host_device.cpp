#include "strata/core/host_device.h"

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "strata/core/bytes.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

/// One in-order queue of work run by its own thread, like a CUDA stream.
class StreamWorker {
 public:
  StreamWorker() : thread_([this] { Run(); }) {}
  ~StreamWorker() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_one();
    thread_.join();  // Runs what is queued before it returns.
  }

  void Enqueue(HostFunction work) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(work));
      ++enqueued_;
    }
    work_ready_.notify_one();
  }

  /// Blocks until every item enqueued before the call has run.
  void Drain() {
    std::unique_lock lock(mutex_);
    const uint64_t target = enqueued_;
    drained_.wait(lock, [&] { return completed_ >= target; });
  }

 private:
  void Run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      work_ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      HostFunction work = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      work();
      lock.lock();
      ++completed_;
      drained_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable drained_;
  std::deque<HostFunction> queue_;
  uint64_t enqueued_ = 0;
  uint64_t completed_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // Last: starts after the members it uses exist.
};

/// Shared between the event handle and the work items that complete or wait on it, so an event
/// may be destroyed while a stream still refers to it (CUDA allows this too).
struct HostEventState {
  std::mutex mutex;
  std::condition_variable completed_cv;
  uint64_t recorded = 0;   // Sequence number of the latest record.
  uint64_t completed = 0;  // Highest sequence number whose work has run.

  void WaitFor(uint64_t sequence) {
    std::unique_lock lock(mutex);
    completed_cv.wait(lock, [&] { return completed >= sequence; });
  }
};
using HostEventPtr = std::shared_ptr<HostEventState>;

class HostDevice final : public Device {
 public:
  explicit HostDevice(const HostDeviceOptions& options) : options_(options) {
    properties_.kind = DeviceKind::kHost;
    properties_.name = "HostDevice (" + FormatBytes(options.memory_budget_bytes) + " budget, " +
                       (options.copy_bytes_per_second > 0
                            ? FormatBandwidth(options.copy_bytes_per_second) + " copies"
                            : std::string("unthrottled copies")) +
                       (options.host_accessible ? ", host-accessible" : "") + ")";
    properties_.total_memory_bytes = options.memory_budget_bytes;
    properties_.host_accessible = options.host_accessible;
  }

  const DeviceProperties& properties() const override { return properties_; }

  DeviceMemoryInfo memory_info() const override {
    std::lock_guard lock(memory_mutex_);
    return {options_.memory_budget_bytes, used_bytes_, peak_bytes_,
            options_.memory_budget_bytes - used_bytes_};
  }

  Result<DeviceBuffer> Allocate(size_t bytes) override {
    const uint64_t rounded = AllocationSize(bytes);
    {
      std::lock_guard lock(memory_mutex_);
      if (rounded > options_.memory_budget_bytes - used_bytes_) {
        return ResourceExhausted("host device: allocating " + FormatBytes(rounded) +
                                 " would exceed the device memory budget of " +
                                 FormatBytes(options_.memory_budget_bytes) + " (" +
                                 FormatBytes(used_bytes_) + " in use)");
      }
      used_bytes_ += rounded;
      peak_bytes_ = std::max(peak_bytes_, used_bytes_);
    }
    void* memory = std::aligned_alloc(kAllocationAlignment, rounded);
    if (memory == nullptr) {
      ReturnBytes(rounded);
      return ResourceExhausted("host device: the system has no memory for " + FormatBytes(rounded));
    }
    return MakeBuffer(memory, bytes);  // The handle reports what was asked for.
  }

  Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes,
                      Stream stream) override {
    return EnqueueCopy(device_dst, host_src, bytes, stream);
  }
  Status CopyToHost(void* host_dst, const void* device_src, size_t bytes, Stream stream) override {
    return EnqueueCopy(host_dst, device_src, bytes, stream);
  }

  Status LaunchHostFunction(Stream stream, HostFunction function) override {
    STRATA_RETURN_IF_ERROR(CheckStream(stream));
    if (!function) return InvalidArgument("host device: empty host function");
    Worker(stream).Enqueue(std::move(function));
    return Status();
  }

  Result<DeviceEvent> CreateEvent() override {
    return MakeEvent(new HostEventPtr(std::make_shared<HostEventState>()));
  }

  Status RecordEvent(DeviceEvent& event, Stream stream) override {
    STRATA_RETURN_IF_ERROR(CheckStream(stream));
    STRATA_ASSIGN_OR_RETURN(HostEventPtr state, StateOf(event));
    Worker(stream).Enqueue(Completion(state));
    return Status();
  }

  Status RecordEventOnNativeStream(DeviceEvent& event, void* native_stream) override {
    if (native_stream == nullptr) return InvalidArgument("host device: null native stream");
    STRATA_ASSIGN_OR_RETURN(HostEventPtr state, StateOf(event));
    static_cast<HostStream*>(native_stream)->Enqueue(Completion(state));
    return Status();
  }

  Status StreamWaitEvent(Stream stream, const DeviceEvent& event) override {
    STRATA_RETURN_IF_ERROR(CheckStream(stream));
    STRATA_ASSIGN_OR_RETURN(HostEventPtr state, StateOf(event));
    uint64_t sequence;
    {
      std::lock_guard lock(state->mutex);
      sequence = state->recorded;
    }
    if (sequence == 0) return Status();  // Never recorded: nothing to wait for.
    Worker(stream).Enqueue([state, sequence] { state->WaitFor(sequence); });
    return Status();
  }

  Status SynchronizeEvent(const DeviceEvent& event) override {
    STRATA_ASSIGN_OR_RETURN(HostEventPtr state, StateOf(event));
    uint64_t sequence;
    {
      std::lock_guard lock(state->mutex);
      sequence = state->recorded;
    }
    state->WaitFor(sequence);
    return Status();
  }

  Result<bool> QueryEvent(const DeviceEvent& event) override {
    STRATA_ASSIGN_OR_RETURN(HostEventPtr state, StateOf(event));
    std::lock_guard lock(state->mutex);
    return state->completed >= state->recorded;
  }

  Status SynchronizeStream(Stream stream) override {
    STRATA_RETURN_IF_ERROR(CheckStream(stream));
    Worker(stream).Drain();
    return Status();
  }

  bool CanPin() const override { return true; }

  Result<PinnedHostRegion> PinHostMemory(void* host, size_t bytes) override {
    // Host memory is already where this device's streams read it; a pinned region here only
    // records the registration so callers follow the same protocol as on CUDA.
    if (host == nullptr || bytes == 0) {
      return InvalidArgument("host device: pinning needs a non-empty host region");
    }
    return MakePinnedRegion(host, bytes);
  }

 protected:
  void Release(internal::HandleKind kind, void* pointer, size_t bytes) noexcept override {
    switch (kind) {
      case internal::HandleKind::kMemory:
        std::free(pointer);
        ReturnBytes(AllocationSize(bytes));
        break;
      case internal::HandleKind::kEvent: delete static_cast<HostEventPtr*>(pointer); break;
      case internal::HandleKind::kPinnedRegion: break;
    }
  }

 private:
  // Page-aligned blocks (cudaMalloc gives 256 bytes; a page also keeps O_DIRECT transfers
  // straight into "device" memory legal in tests).
  static constexpr uint64_t kAllocationAlignment = 4096;

  /// What an allocation of `bytes` takes from the budget.
  static uint64_t AllocationSize(size_t bytes) {
    return AlignUp(bytes == 0 ? 1 : bytes, kAllocationAlignment);
  }

  static Status CheckStream(Stream stream) {
    const int index = static_cast<int>(stream);
    if (index < 0 || index >= kStreamCount) {
      return InvalidArgument("host device: no stream " + std::to_string(index));
    }
    return Status();
  }

  StreamWorker& Worker(Stream stream) { return workers_[static_cast<size_t>(stream)]; }

  /// Moves `state`'s marker to a new record and returns the work that completes it, to queue
  /// where the record is made.
  static HostFunction Completion(const HostEventPtr& state) {
    uint64_t sequence;
    {
      std::lock_guard lock(state->mutex);
      sequence = ++state->recorded;
    }
    return [state, sequence] {
      {
        std::lock_guard lock(state->mutex);
        state->completed = std::max(state->completed, sequence);
      }
      state->completed_cv.notify_all();
    };
  }

  Result<HostEventPtr> StateOf(const DeviceEvent& event) const {
    STRATA_ASSIGN_OR_RETURN(void* native, NativeEvent(event));
    return *static_cast<HostEventPtr*>(native);
  }

  void ReturnBytes(uint64_t bytes) {
    std::lock_guard lock(memory_mutex_);
    used_bytes_ -= bytes;
  }

  Status EnqueueCopy(void* dst, const void* src, size_t bytes, Stream stream) {
    STRATA_RETURN_IF_ERROR(CheckStream(stream));
    if (bytes == 0) return Status();
    if (dst == nullptr || src == nullptr) return InvalidArgument("host device: copy with null");
    const double bytes_per_second = options_.copy_bytes_per_second;
    Worker(stream).Enqueue([dst, src, bytes, bytes_per_second] {
      const auto start = Clock::now();
      std::memcpy(dst, src, bytes);
      if (bytes_per_second > 0) {
        const auto target =
            std::chrono::duration<double>(static_cast<double>(bytes) / bytes_per_second);
        std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(target));
      }
    });
    return Status();
  }

  const HostDeviceOptions options_;
  DeviceProperties properties_;
  mutable std::mutex memory_mutex_;
  uint64_t used_bytes_ = 0;
  uint64_t peak_bytes_ = 0;
  // Last member: destroyed first, so queued work finishes while the rest still exists.
  std::array<StreamWorker, kStreamCount> workers_;
};

}  // namespace

class HostStream::Worker : public StreamWorker {};

HostStream::HostStream() : worker_(std::make_unique<Worker>()) {}
HostStream::~HostStream() = default;
void HostStream::Enqueue(HostFunction work) { worker_->Enqueue(std::move(work)); }
void HostStream::Synchronize() { worker_->Drain(); }

Result<std::unique_ptr<Device>> CreateHostDevice(const HostDeviceOptions& options) {
  if (!(options.copy_bytes_per_second >= 0)) {
    return InvalidArgument("host device: copy bandwidth must be >= 0 bytes/s (0 = unthrottled)");
  }
  return std::unique_ptr<Device>(new HostDevice(options));
}

}  // namespace strata
