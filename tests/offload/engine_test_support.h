// What the engine tests share: the tiny model's chunking, placements, options and comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "device_under_test.h"
#include "strata/core/host_device.h"
#include "strata/nvme/fault_injection.h"
#include "strata/offload/engine.h"
#include "tiny_model.h"

namespace strata::offload::testing {

constexpr int kLayers = 6;
constexpr int kWidth = 64;
constexpr int kBatch = 8;
// One layer (64x64 weight + bias) per chunk: 4160 fp32 elements, padded to 5120.
constexpr uint64_t kChunkBytes = 20 * 1024;
constexpr uint64_t kSlotBytes = 2 * 5120 * 4;  // Working params + grads of one fp32 chunk.

struct Placement {
  const char* name;
  Tier states;
  Tier params;
  double ratio = 1.0;
  uint64_t device_budget = 64 << 20;
  uint64_t states_in_host = 0;  ///< placement.max_states_in_host (states on nvme).
};

/// Every placement the equivalence tests run through: states on each tier, partial offload,
/// states split across host and NVMe, and offloaded parameters under device budgets that force
/// evictions.
inline const Placement kPlacements[] = {
    {"states_device", Tier::kDevice, Tier::kDevice},
    {"states_host", Tier::kHost, Tier::kDevice},
    {"states_nvme", Tier::kNvme, Tier::kDevice},
    {"states_host_ratio_half", Tier::kHost, Tier::kDevice, 0.5},
    {"states_nvme_ratio_half", Tier::kNvme, Tier::kDevice, 0.5},
    // Three of the six chunks' states (5120 fp32 x 3) fit in host memory.
    {"states_nvme_half_in_host", Tier::kNvme, Tier::kDevice, 1.0, 64 << 20, 3 * 5120 * 12},
    // Two chunks' worth of device memory for six chunks: evictions.
    {"params_host", Tier::kHost, Tier::kHost, 1.0, 2 * kSlotBytes},
    {"params_nvme", Tier::kNvme, Tier::kNvme, 1.0, 3 * kSlotBytes},
    {"params_nvme_states_host", Tier::kHost, Tier::kNvme, 1.0, 2 * kSlotBytes},
};

inline EngineOptions MakeOptions(const Placement& p, const std::string& nvme_path,
                                 DType dtype = DType::kFp32) {
  EngineOptions o;
  o.precision.working_dtype = dtype;
  o.placement.optimizer_states = p.states;
  o.placement.params = p.params;
  o.placement.offload_ratio = p.ratio;
  o.placement.max_states_in_host = p.states_in_host;
  o.placement.chunk_bytes = kChunkBytes;
  o.placement.prefetch_depth = 1;
  o.nvme.paths = {nvme_path};
  o.optimizer.lr = 3e-3;
  o.optimizer.cpu_threads = 2;
  o.host.optimizer_buffer_count = 3;
  o.host.param_buffer_count = 2;
  return o;
}

/// How gtest shows it (in test names and failures).
inline void PrintTo(const Placement& p, std::ostream* out) { *out << p.name; }

/// Whether `p` runs on `kind`. No updater steps states in a GPU's memory yet (update/updaters.cpp),
/// so placements that keep optimizer states on the device run on the host device only (a CUDA
/// device refuses them: EngineContractTest.ACudaDeviceIsTreatedAsOneWhateverTheOptionsSay).
inline bool RunsOn(const Placement& p, DeviceUnderTest kind) {
  return kind == DeviceUnderTest::kHost || (p.states != Tier::kDevice && p.ratio == 1.0);
}

/// A placement on a device: the parameter of the suites that run on each device.
using PlacementOnDevice = std::tuple<DeviceUnderTest, Placement>;

/// The placements of `placements` that run on `kind`, for INSTANTIATE_TEST_SUITE_P.
inline std::vector<PlacementOnDevice> PlacementsOn(
    DeviceUnderTest kind, std::span<const Placement> placements = kPlacements) {
  std::vector<PlacementOnDevice> out;
  for (const Placement& p : placements) {
    if (RunsOn(p, kind)) out.emplace_back(kind, p);
  }
  return out;
}

/// Names an instance by its placement (the instantiation's name says the device).
inline std::string PlacementName(const ::testing::TestParamInfo<PlacementOnDevice>& info) {
  return std::get<1>(info.param).name;
}

/// The fixture of a suite that runs one placement on one device: skips (or fails under
/// STRATA_EXPECT_GPU=1) where the device cannot run, and makes that device.
class PlacementOnDeviceTest : public ::testing::TestWithParam<PlacementOnDevice> {
 protected:
  void SetUp() override { STRATA_SKIP_UNLESS_USABLE(device_kind()); }
  DeviceUnderTest device_kind() const { return std::get<0>(GetParam()); }
  const Placement& placement() const { return std::get<1>(GetParam()); }
  std::unique_ptr<Device> MakeDevice(uint64_t budget) const {
    return MakeDeviceUnderTest(device_kind(), budget);
  }
};

/// The fixture of a suite that runs on each device (instantiated as Host/ and Cuda/).
class OnDeviceTest : public ::testing::TestWithParam<DeviceUnderTest> {
 protected:
  void SetUp() override { STRATA_SKIP_UNLESS_USABLE(device_kind()); }
  DeviceUnderTest device_kind() const { return GetParam(); }
  std::unique_ptr<Device> MakeDevice(uint64_t budget) const {
    return MakeDeviceUnderTest(device_kind(), budget);
  }
};

/// A HostDevice standing for a GPU (every copy made), or with `host_accessible` for the CPU
/// itself (zero copy, as strata.torch's CPU tensors run).
inline std::unique_ptr<Device> MakeDevice(uint64_t budget, bool host_accessible = false) {
  return std::move(
             CreateHostDevice({.memory_budget_bytes = budget, .host_accessible = host_accessible}))
      .value();
}

/// An environment whose NVMe backend obeys `plan`.
inline EngineEnvironment FaultyNvme(const std::shared_ptr<nvme::FaultPlan>& plan) {
  EngineEnvironment environment;
  environment.wrap_io_backend = [plan](std::unique_ptr<nvme::IoBackend> inner) {
    return nvme::CreateFaultInjectingBackend(std::move(inner), plan);
  };
  return environment;
}

inline bool BitEqual(const std::vector<std::vector<float>>& a,
                     const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t p = 0; p < a.size(); ++p) {
    if (a[p].size() != b[p].size() ||
        std::memcmp(a[p].data(), b[p].data(), a[p].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

inline double MaxAbsDiff(const std::vector<std::vector<float>>& a,
                         const std::vector<std::vector<float>>& b) {
  double worst = 0.0;
  for (size_t p = 0; p < a.size(); ++p) {
    for (size_t i = 0; i < a[p].size(); ++i) {
      worst = std::max(worst, std::abs(double(a[p][i]) - double(b[p][i])));
    }
  }
  return worst;
}

/// An engine for `model`'s parameters; null (and a test failure naming why) if Create fails.
inline std::unique_ptr<Engine> MakeEngine(const EngineOptions& options, Device& device,
                                          const TinyModel& model,
                                          EngineEnvironment environment = {}) {
  const auto specs = model.Specs();
  auto engine = Engine::Create(options, device, specs, std::move(environment));
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

}  // namespace strata::offload::testing

/// Instantiates an OnDeviceTest suite on each device: Host/suite.* and Cuda/suite.*.
#define STRATA_INSTANTIATE_ON_EACH_DEVICE(suite)                                        \
  INSTANTIATE_TEST_SUITE_P(                                                              \
      Host, suite, ::testing::Values(::strata::offload::testing::DeviceUnderTest::kHost)); \
  INSTANTIATE_TEST_SUITE_P(                                                              \
      Cuda, suite, ::testing::Values(::strata::offload::testing::DeviceUnderTest::kCuda))

/// Instantiates a PlacementOnDeviceTest suite with every placement (kPlacements) that runs on
/// each device: Host/suite.*/<placement> and Cuda/suite.*/<placement>.
#define STRATA_INSTANTIATE_PLACEMENTS_ON_EACH_DEVICE(suite)                                 \
  INSTANTIATE_TEST_SUITE_P(Host, suite,                                                    \
                           ::testing::ValuesIn(::strata::offload::testing::PlacementsOn(    \
                               ::strata::offload::testing::DeviceUnderTest::kHost)),        \
                           ::strata::offload::testing::PlacementName);                      \
  INSTANTIATE_TEST_SUITE_P(Cuda, suite,                                                    \
                           ::testing::ValuesIn(::strata::offload::testing::PlacementsOn(    \
                               ::strata::offload::testing::DeviceUnderTest::kCuda)),        \
                           ::strata::offload::testing::PlacementName)
