// The updater seam (update/updater.h): the CPU updater steps a chunk's segments as the kernels
// do, each with its group's settings, and the registry says which tiers a device's updaters
// serve.
#include "update/cpu_updater.h"

#include <gtest/gtest.h>

#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/host_device.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "update/updater.h"
#include "wrapped_device.h"

namespace strata::offload {
namespace {

constexpr size_t kNumel = 64;

/// A chunk of two segments (the second with its own weight decay and half the learning rate)
/// as master | exp_avg | exp_avg_sq, and gradients.
struct TwoSegmentChunk {
  std::vector<float> states = std::vector<float>(3 * kNumel, 0.0f);
  std::vector<float> grads = std::vector<float>(kNumel);
  std::vector<ChunkSegment> segments{{.begin = 0, .end = 40},
                                     {.begin = 40, .end = kNumel, .weight_decay = 0.5,
                                      .lr_scale = 0.5}};
  TwoSegmentChunk() {
    for (size_t i = 0; i < kNumel; ++i) {
      states[i] = 0.01f * float(i) - 0.3f;
      grads[i] = 0.02f * float(kNumel - i) - 0.5f;
    }
  }
};

TEST(UpdaterTest, TheCpuUpdaterStepsEachSegmentWithItsGroupsSettings) {
  auto cpu = cpu_adam::CpuOptimizer::Create({.threads = 1});
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  CpuUpdater updater(*cpu);
  OptimizerOptions o;
  o.type = OptimizerType::kAdamW;
  o.weight_decay = 0.01;
  TwoSegmentChunk chunk;
  std::vector<float> out(3 * kNumel, -1.0f);
  std::vector<uint16_t> params(kNumel);
  ASSERT_TRUE(updater
                  .Update({.optimizer = &o,
                           .segments = chunk.segments,
                           .numel = kNumel,
                           .states = chunk.states.data(),
                           .states_out = out.data(),
                           .grads = chunk.grads.data(),
                           .param_copy = params.data(),
                           .working_dtype = DType::kBf16,
                           .lr = 1e-2,
                           .step = 3,
                           .grad_scale = 0.5})
                  .ok());
  // The same arithmetic called segment by segment on the kernels directly.
  TwoSegmentChunk reference;
  for (const ChunkSegment& s : reference.segments) {
    const size_t n = s.end - s.begin;
    ASSERT_TRUE(cpu->Step(cpu_adam::AdamWHyperParams{.lr = 1e-2 * s.lr_scale,
                                                    .beta1 = o.beta1,
                                                    .beta2 = o.beta2,
                                                    .eps = o.eps,
                                                    .weight_decay = s.weight_decay.value_or(0.01),
                                                    .bias_correction = o.bias_correction,
                                                    .step = 3,
                                                    .grad_scale = 0.5},
                          {.numel = n,
                           .params = reference.states.data() + s.begin,
                           .grads = reference.grads.data() + s.begin,
                           .exp_avg = reference.states.data() + kNumel + s.begin,
                           .exp_avg_sq = reference.states.data() + 2 * kNumel + s.begin})
                    .ok());
  }
  EXPECT_EQ(out, reference.states);  // Out of place, bit for bit.
  EXPECT_NE(chunk.states, reference.states);  // ... and the inputs untouched.
  for (size_t i = 0; i < kNumel; ++i) {
    ASSERT_EQ(params[i], Fp32ToBf16(reference.states[i])) << i;
  }
}

TEST(UpdaterTest, AHostDeviceHasAnUpdaterForItsMemoryAndAGpuNone) {
  auto cpu = cpu_adam::CpuOptimizer::Create({.threads = 1});
  ASSERT_TRUE(cpu.ok());
  auto host = CreateHostDevice({.memory_budget_bytes = 1 << 20});
  ASSERT_TRUE(host.ok());
  auto on_host = Updaters::Create({.device = **host, .cpu = *cpu});
  ASSERT_TRUE(on_host.ok()) << on_host.status().ToString();
  EXPECT_EQ(on_host->host().name(), "cpu");
  ASSERT_NE(on_host->device(), nullptr);
  EXPECT_FALSE(on_host->device()->queues_on_device());
  EXPECT_TRUE(Updaters::CheckDeviceStatesServed(**host).ok());

  testing::WrappedDevice gpu(**host);
  gpu.ReportKind(DeviceKind::kCuda);
  auto on_gpu = Updaters::Create({.device = gpu, .cpu = *cpu});
  ASSERT_TRUE(on_gpu.ok());
  EXPECT_EQ(on_gpu->host().name(), "cpu");  // Host- and NVMe-kept states step on the CPU.
  EXPECT_EQ(on_gpu->device(), nullptr);
  const Status refused = Updaters::CheckDeviceStatesServed(gpu);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find("a cuda device"), std::string::npos) << refused.ToString();
}

}  // namespace
}  // namespace strata::offload
