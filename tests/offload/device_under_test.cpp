#include "device_under_test.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "strata/core/cuda_device.h"
#include "strata/core/host_device.h"

#if STRATA_TEST_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace strata::offload::testing {
namespace {

// Whether GPU 0 can be used, by making a CudaDevice on it as the tests do.
std::optional<std::string> WhyNoCuda() {
  if (!BuiltWithCuda()) return "built without CUDA";
  Result<std::unique_ptr<Device>> gpu = CreateCudaDevice({.device_index = 0});
  if (!gpu.ok()) return "no usable GPU: " + gpu.status().ToString();
  return std::nullopt;
}

class HostOutsideStream final : public OutsideStream {
 public:
  Status Sleep(std::chrono::milliseconds delay) override {
    stream_.Enqueue([delay] { std::this_thread::sleep_for(delay); });
    return Status();
  }
  Status Write(void* dst, const void* src, size_t bytes) override {
    const auto* first = static_cast<const std::byte*>(src);
    stream_.Enqueue([dst, data = std::vector<std::byte>(first, first + bytes)] {
      std::memcpy(dst, data.data(), data.size());
    });
    return Status();
  }
  Status Synchronize() override {
    stream_.Synchronize();
    return Status();
  }
  void* native() override { return stream_.native(); }

 private:
  HostStream stream_;
};

#if STRATA_TEST_WITH_CUDA
Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status();
  return Internal(std::string(what) + ": " + cudaGetErrorString(error));
}

// On GPU 0, the device the tests' CudaDevice runs on. Writes go through pinned memory (a copy
// from pageable memory would first wait for the stream, so the work queued before it, a
// Sleep, would be over by the time GradsReady names the stream); it is freed once the stream
// has run, in Synchronize or the destructor (a host function must not call CUDA).
class CudaOutsideStream final : public OutsideStream {
 public:
  static Result<std::unique_ptr<OutsideStream>> Create() {
    STRATA_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(0), "cudaSetDevice"));
    cudaStream_t stream = nullptr;
    STRATA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
    return std::unique_ptr<OutsideStream>(new CudaOutsideStream(stream));
  }
  ~CudaOutsideStream() override {
    cudaStreamSynchronize(stream_);
    FreeStaging();
    cudaStreamDestroy(stream_);
  }

  Status Sleep(std::chrono::milliseconds delay) override {
    return Queue([delay] { std::this_thread::sleep_for(delay); });
  }
  Status Write(void* dst, const void* src, size_t bytes) override {
    void* pinned = nullptr;
    STRATA_RETURN_IF_ERROR(CudaStatus(cudaMallocHost(&pinned, bytes), "cudaMallocHost"));
    staging_.push_back(pinned);
    std::memcpy(pinned, src, bytes);
    return CudaStatus(cudaMemcpyAsync(dst, pinned, bytes, cudaMemcpyHostToDevice, stream_),
                      "cudaMemcpyAsync");
  }
  Status Synchronize() override {
    STRATA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
    FreeStaging();
    return Status();
  }
  void* native() override { return stream_; }

 private:
  explicit CudaOutsideStream(cudaStream_t stream) : stream_(stream) {}

  void FreeStaging() {
    for (void* pinned : staging_) cudaFreeHost(pinned);
    staging_.clear();
  }

  Status Queue(std::function<void()> work) {
    auto* heap = new std::function<void()>(std::move(work));
    const cudaError_t error = cudaLaunchHostFunc(
        stream_,
        [](void* user) {
          auto* f = static_cast<std::function<void()>*>(user);
          (*f)();
          delete f;
        },
        heap);
    if (error != cudaSuccess) delete heap;
    return CudaStatus(error, "cudaLaunchHostFunc");
  }

  cudaStream_t stream_;
  std::vector<void*> staging_;  // Pinned copies of what Write was given; the test's thread only.
};
#endif

}  // namespace

std::optional<std::string> WhyUnusable(DeviceUnderTest kind) {
  if (kind == DeviceUnderTest::kHost) return std::nullopt;
  static const std::optional<std::string> why = WhyNoCuda();
  return why;
}

std::unique_ptr<Device> MakeDeviceUnderTest(DeviceUnderTest kind, uint64_t budget) {
  Result<std::unique_ptr<Device>> device =
      kind == DeviceUnderTest::kHost
          ? CreateHostDevice({.memory_budget_bytes = budget})
          : CreateCudaDevice({.device_index = 0, .memory_budget_bytes = budget});
  EXPECT_TRUE(device.ok()) << DeviceUnderTestName(kind) << ": " << device.status().ToString();
  return device.ok() ? std::move(device).value() : nullptr;
}

Status ReadDeviceMemory(Device& device, const void* src, void* dst, size_t bytes) {
  if (InPlace(device)) {
    std::memcpy(dst, src, bytes);
    return Status();
  }
  STRATA_RETURN_IF_ERROR(device.CopyToHost(dst, src, bytes, Stream::kCompute));
  return device.SynchronizeStream(Stream::kCompute);
}

Status WriteDeviceMemory(Device& device, void* dst, const void* src, size_t bytes) {
  if (InPlace(device)) {
    std::memcpy(dst, src, bytes);
    return Status();
  }
  STRATA_RETURN_IF_ERROR(device.CopyToDevice(dst, src, bytes, Stream::kCompute));
  return device.SynchronizeStream(Stream::kCompute);
}

Result<StagingBuffer> StagingBuffer::Create(Device& device, size_t bytes) {
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer memory, AlignedBuffer::Allocate(bytes));
  PinnedHostRegion pinned;
  if (!InPlace(device) && device.CanPin()) {
    STRATA_ASSIGN_OR_RETURN(pinned, device.PinHostMemory(memory.data(), memory.size()));
  }
  return StagingBuffer(std::move(memory), std::move(pinned));
}

Result<std::unique_ptr<OutsideStream>> OutsideStream::Create(const Device& device) {
  if (InPlace(device)) {
    return std::unique_ptr<OutsideStream>(std::make_unique<HostOutsideStream>());
  }
#if STRATA_TEST_WITH_CUDA
  return CudaOutsideStream::Create();
#else
  return Unavailable("an outside CUDA stream needs a build with CUDA");
#endif
}

}  // namespace strata::offload::testing
