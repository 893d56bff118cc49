// CudaDevice on the CUDA runtime. Compiled only when the build has CUDA; the only file of core/
// that includes CUDA headers.
#include "strata/core/cuda_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <mutex>
#include <string>

#include "strata/core/bytes.h"

namespace strata {
namespace {

// cudaHostRegister is limited per call; larger regions are registered in pieces this big.
constexpr uint64_t kMaxPinPiece = uint64_t{64} << 30;

Status CudaError(cudaError_t error, const char* expression, const char* file, int line) {
  return Internal(std::string("CUDA call ") + expression + " failed at " + file + ":" +
                  std::to_string(line) + ": " + cudaGetErrorName(error) + " (" +
                  cudaGetErrorString(error) + ")");
}

#define STRATA_CUDA_CHECK(expr)                                        \
  do {                                                                 \
    const cudaError_t strata_cuda_error_ = (expr);                     \
    if (strata_cuda_error_ != cudaSuccess)                             \
      return CudaError(strata_cuda_error_, #expr, __FILE__, __LINE__); \
  } while (0)

/// PCIe generation from sysfs's "current_link_speed" ("32.0 GT/s PCIe"), 0 when unknown.
int PcieGenerationFromSpeed(double gigatransfers) {
  constexpr std::array<double, 6> kSpeeds = {2.5, 5.0, 8.0, 16.0, 32.0, 64.0};
  for (size_t i = 0; i < kSpeeds.size(); ++i) {
    if (gigatransfers > kSpeeds[i] - 0.5 && gigatransfers < kSpeeds[i] + 0.5) {
      return static_cast<int>(i) + 1;
    }
  }
  return 0;
}

/// Reads the link from /sys/bus/pci/devices/<bus id>/; the CUDA runtime does not report it.
void ReadPcieLink(DeviceProperties& properties) {
  std::string bus_id = properties.pci_bus_id;
  std::transform(bus_id.begin(), bus_id.end(), bus_id.begin(), ::tolower);
  const std::string dir = "/sys/bus/pci/devices/" + bus_id + "/";
  double speed = 0;
  if (std::ifstream in(dir + "current_link_speed"); in >> speed) {
    properties.pcie_generation = PcieGenerationFromSpeed(speed);
  }
  if (std::ifstream in(dir + "current_link_width"); in >> properties.pcie_width) {
  }
}

/// Our properties of GPU `index`; `prop` receives the runtime's, for callers that want more.
Result<DeviceProperties> QueryProperties(int index, cudaDeviceProp& prop) {
  STRATA_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  DeviceProperties properties;
  properties.kind = DeviceKind::kCuda;
  properties.name = prop.name;
  properties.total_memory_bytes = prop.totalGlobalMem;
  std::array<char, 32> bus_id{};
  if (cudaDeviceGetPCIBusId(bus_id.data(), static_cast<int>(bus_id.size()), index) == cudaSuccess) {
    properties.pci_bus_id = bus_id.data();
    ReadPcieLink(properties);
  }
  return properties;
}

Status CheckDeviceCount(int& count) {
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    return Unavailable(std::string("no CUDA device is usable here: ") +
                       (error != cudaSuccess ? cudaGetErrorString(error) : "0 devices found"));
  }
  return Status();
}

void HostFunctionTrampoline(void* user_data) {
  auto* function = static_cast<HostFunction*>(user_data);
  (*function)();
  delete function;
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int index, DeviceProperties properties, uint64_t budget)
      : index_(index), properties_(std::move(properties)), budget_(budget) {}

  Status Init() {
    STRATA_CUDA_CHECK(cudaSetDevice(index_));
    for (cudaStream_t& stream : streams_) {
      STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    }
    return Status();
  }

  ~CudaDevice() override {
    if (cudaSetDevice(index_) != cudaSuccess) return;
    for (cudaStream_t stream : streams_) {
      if (stream == nullptr) continue;
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
  }

  const DeviceProperties& properties() const override { return properties_; }

  DeviceMemoryInfo memory_info() const override {
    DeviceMemoryInfo info;
    info.budget_bytes = budget_;
    {
      std::lock_guard lock(memory_mutex_);
      info.used_bytes = used_bytes_;
      info.peak_bytes = peak_bytes_;
    }
    // What Allocate can still hand out: the budget left, or less when the GPU has less free
    // (other processes, the CUDA context itself).
    info.free_bytes = budget_ > info.used_bytes ? budget_ - info.used_bytes : 0;
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(index_) == cudaSuccess &&
        cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      info.free_bytes = std::min<uint64_t>(info.free_bytes, free_bytes);
    }
    return info;
  }

  Result<DeviceBuffer> Allocate(size_t bytes) override {
    const uint64_t size = std::max<uint64_t>(bytes, 1);
    {
      std::lock_guard lock(memory_mutex_);
      if (size > budget_ - used_bytes_) {
        return ResourceExhausted("cuda device " + std::to_string(index_) + ": allocating " +
                                 FormatBytes(size) + " would exceed the device memory budget of " +
                                 FormatBytes(budget_) + " (" + FormatBytes(used_bytes_) +
                                 " in use)");
      }
      used_bytes_ += size;
      peak_bytes_ = std::max(peak_bytes_, used_bytes_);
    }
    void* pointer = nullptr;
    cudaError_t error = cudaSetDevice(index_);
    if (error == cudaSuccess) error = cudaMalloc(&pointer, size);
    if (error != cudaSuccess) {
      ReturnBytes(size);
      if (error == cudaErrorMemoryAllocation) {
        return ResourceExhausted("cuda device " + std::to_string(index_) + ": cudaMalloc of " +
                                 FormatBytes(size) + " failed: out of device memory");
      }
      return CudaError(error, "cudaMalloc", __FILE__, __LINE__);
    }
    return MakeBuffer(pointer, bytes);
  }

  Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes,
                      Stream stream) override {
    STRATA_CUDA_CHECK(cudaSetDevice(index_));
    STRATA_CUDA_CHECK(
        cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, Native(stream)));
    return Status();
  }

  Status CopyToHost(void* host_dst, const void* device_src, size_t bytes, Stream stream) override {
    STRATA_CUDA_CHECK(cudaSetDevice(index_));
    STRATA_CUDA_CHECK(
        cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, Native(stream)));
    return Status();
  }

  Status LaunchHostFunction(Stream stream, HostFunction function) override {
    if (!function) return InvalidArgument("cuda device: empty host function");
    STRATA_CUDA_CHECK(cudaSetDevice(index_));
    auto* heap_function = new HostFunction(std::move(function));
    const cudaError_t error =
        cudaLaunchHostFunc(Native(stream), &HostFunctionTrampoline, heap_function);
    if (error != cudaSuccess) {
      delete heap_function;
      return CudaError(error, "cudaLaunchHostFunc", __FILE__, __LINE__);
    }
    return Status();
  }

  Result<DeviceEvent> CreateEvent() override {
    STRATA_CUDA_CHECK(cudaSetDevice(index_));
    cudaEvent_t event = nullptr;
    STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return MakeEvent(event);
  }

  Status RecordEvent(DeviceEvent& event, Stream stream) override {
    STRATA_ASSIGN_OR_RETURN(void* native, NativeEvent(event));
    STRATA_CUDA_CHECK(cudaSetDevice(index_));
    STRATA_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(native), Native(stream)));
    return Status();
  }

  Status RecordEventOnNativeStream(DeviceEvent& event, void* native_stream) override {
    if (native_stream == nullptr) return InvalidArgument("cuda: null native stream");
    STRATA_ASSIGN_OR_RETURN(void* native, NativeEvent(event));
    STRATA_CUDA_CHECK(cudaSetDevice(index_));
    STRATA_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(native),
                                      static_cast<cudaStream_t>(native_stream)));
    return Status();
  }

  Status StreamWaitEvent(Stream stream, const DeviceEvent& event) override {
    STRATA_ASSIGN_OR_RETURN(void* native, NativeEvent(event));
    STRATA_CUDA_CHECK(cudaSetDevice(index_));
    STRATA_CUDA_CHECK(cudaStreamWaitEvent(Native(stream), static_cast<cudaEvent_t>(native), 0));
    return Status();
  }

  Status SynchronizeEvent(const DeviceEvent& event) override {
    STRATA_ASSIGN_OR_RETURN(void* native, NativeEvent(event));
    STRATA_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(native)));
    return Status();
  }

  Result<bool> QueryEvent(const DeviceEvent& event) override {
    STRATA_ASSIGN_OR_RETURN(void* native, NativeEvent(event));
    const cudaError_t error = cudaEventQuery(static_cast<cudaEvent_t>(native));
    if (error == cudaSuccess) return true;
    if (error == cudaErrorNotReady) return false;
    return CudaError(error, "cudaEventQuery", __FILE__, __LINE__);
  }

  Status SynchronizeStream(Stream stream) override {
    STRATA_CUDA_CHECK(cudaSetDevice(index_));
    STRATA_CUDA_CHECK(cudaStreamSynchronize(Native(stream)));
    return Status();
  }

  bool CanPin() const override { return true; }

  Result<PinnedHostRegion> PinHostMemory(void* host, size_t bytes) override {
    if (host == nullptr || bytes == 0) {
      return InvalidArgument("cuda device: pinning needs a non-empty host region");
    }
    STRATA_CUDA_CHECK(cudaSetDevice(index_));
    auto* base = static_cast<std::byte*>(host);
    for (uint64_t offset = 0; offset < bytes; offset += kMaxPinPiece) {
      const uint64_t piece = std::min<uint64_t>(kMaxPinPiece, bytes - offset);
      const cudaError_t error = cudaHostRegister(base + offset, piece, cudaHostRegisterDefault);
      if (error != cudaSuccess) {
        UnpinPieces(base, offset);
        return ResourceExhausted("cuda device: cudaHostRegister of " + FormatBytes(piece) +
                                 " failed: " + cudaGetErrorString(error) +
                                 " (check RLIMIT_MEMLOCK with `ulimit -l`, or lower the pinned "
                                 "host memory budget)");
      }
    }
    return MakePinnedRegion(host, bytes);
  }

  void* NativeStream(Stream stream) const override { return Native(stream); }

 protected:
  void Release(internal::HandleKind kind, void* pointer, size_t bytes) noexcept override {
    cudaSetDevice(index_);
    switch (kind) {
      case internal::HandleKind::kMemory:
        cudaFree(pointer);
        ReturnBytes(std::max<uint64_t>(bytes, 1));
        break;
      case internal::HandleKind::kEvent: cudaEventDestroy(static_cast<cudaEvent_t>(pointer)); break;
      case internal::HandleKind::kPinnedRegion:
        UnpinPieces(static_cast<std::byte*>(pointer), bytes);
        break;
    }
  }

 private:
  cudaStream_t Native(Stream stream) const { return streams_[static_cast<size_t>(stream)]; }

  static void UnpinPieces(std::byte* base, uint64_t bytes) {
    for (uint64_t offset = 0; offset < bytes; offset += kMaxPinPiece) {
      cudaHostUnregister(base + offset);
    }
  }

  void ReturnBytes(uint64_t bytes) {
    std::lock_guard lock(memory_mutex_);
    used_bytes_ -= bytes;
  }

  const int index_;
  const DeviceProperties properties_;
  const uint64_t budget_;
  std::array<cudaStream_t, kStreamCount> streams_{};
  mutable std::mutex memory_mutex_;
  uint64_t used_bytes_ = 0;
  uint64_t peak_bytes_ = 0;
};

}  // namespace

bool BuiltWithCuda() { return true; }

Result<std::string> CudaVersionString() {
  int runtime = 0, driver = 0;
  STRATA_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  cudaDriverGetVersion(&driver);
  auto version = [](int v) {
    return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
  };
  return "runtime " + version(runtime) +
         (driver > 0 ? ", driver " + version(driver) : std::string(", no driver loaded"));
}

Result<std::vector<CudaDeviceInfo>> ListCudaDevices() {
  int count = 0;
  STRATA_RETURN_IF_ERROR(CheckDeviceCount(count));
  std::vector<CudaDeviceInfo> devices;
  for (int index = 0; index < count; ++index) {
    CudaDeviceInfo info;
    info.index = index;
    cudaDeviceProp prop{};
    STRATA_ASSIGN_OR_RETURN(info.properties, QueryProperties(index, prop));
    info.compute_capability_major = prop.major;
    info.compute_capability_minor = prop.minor;
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(index) == cudaSuccess &&
        cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      info.free_memory_bytes = free_bytes;
    }
    devices.push_back(std::move(info));
  }
  return devices;
}

Result<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options) {
  int count = 0;
  STRATA_RETURN_IF_ERROR(CheckDeviceCount(count));
  if (options.device_index < 0 || options.device_index >= count) {
    return InvalidArgument("cuda device index " + std::to_string(options.device_index) +
                           " does not exist; " + std::to_string(count) + " device(s) visible");
  }
  cudaDeviceProp prop{};
  STRATA_ASSIGN_OR_RETURN(DeviceProperties properties, QueryProperties(options.device_index, prop));
  STRATA_CUDA_CHECK(cudaSetDevice(options.device_index));
  size_t free_bytes = 0, total_bytes = 0;
  STRATA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const uint64_t budget =
      options.memory_budget_bytes == 0 ? free_bytes : options.memory_budget_bytes;
  auto device = std::make_unique<CudaDevice>(options.device_index, std::move(properties), budget);
  STRATA_RETURN_IF_ERROR(device->Init());
  return std::unique_ptr<Device>(std::move(device));
}

}  // namespace strata
