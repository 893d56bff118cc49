// The offload engine against a plain in-memory AdamW loop: the same model trained through every
// placement must give the same losses and parameters, bit for bit in fp32.
#include "strata/offload/engine.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <span>

#include "engine_test_support.h"
#include "strata/core/host_device.h"
#include "strata/core/log.h"
#include "strata/nvme/fault_injection.h"
#include "support/scratch_dir.h"
#include "tiny_model.h"
namespace strata::offload {
namespace {

using strata::testing::ScratchDir;

using testing::BitEqual;
using testing::EngineTrainer;
using testing::kBatch;
using testing::kLayers;
using testing::kSlotBytes;
using testing::kWidth;
using testing::MakeDevice;
using testing::MakeOptions;
using testing::MaxAbsDiff;
using testing::Placement;
using testing::ReferenceTrainer;
using testing::TinyModel;

class EngineEquivalenceTest : public testing::PlacementOnDeviceTest {};

TEST_P(EngineEquivalenceTest, ThirtyStepsMatchTheReferenceBitForBit) {
  const Placement& placement = this->placement();
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions(placement, nvme.path());
  auto device = MakeDevice(placement.device_budget);
  ASSERT_NE(device, nullptr);
  const auto specs = model.Specs();
  auto engine = Engine::Create(options, *device, specs);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_EQ((*engine)->chunk_count(), size_t(kLayers));

  EngineTrainer trainer(**engine, model);
  ReferenceTrainer reference(model, options);
  for (int step = 0; step < 30; ++step) {
    double loss = 0.0;
    Result<StepReport> report = trainer.TrainStep(step, &loss);
    ASSERT_TRUE(report.ok()) << "step " << step << ": " << report.status().ToString();
    EXPECT_FALSE(report->skipped);
    EXPECT_EQ(report->step, step + 1);
    const double expected = reference.TrainStep(step);
    ASSERT_EQ(loss, expected) << "step " << step;
  }
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()))
      << "max |diff| " << MaxAbsDiff(trainer.MasterParameters(), reference.master());

  const TierUsage device_usage = (*engine)->tier_usage(Tier::kDevice);
  EXPECT_LE(device_usage.peak_bytes, device_usage.budget_bytes);
  EXPECT_LE((*engine)->tier_usage(Tier::kHost).peak_bytes,
            (*engine)->tier_usage(Tier::kHost).budget_bytes);
  const EngineCounters counters = (*engine)->counters();
  if (placement.states == Tier::kNvme) {
    EXPECT_GT(counters.nvme_read_bytes, 0u);
    EXPECT_GT(counters.nvme_write_bytes, 0u);
  }
  if (placement.params != Tier::kDevice && placement.device_budget < kLayers * kSlotBytes) {
    EXPECT_GT(counters.evictions, 0u) << "the budget should have forced evictions";
  }
  if (placement.ratio < 1.0) {
    EXPECT_GT(counters.device_optimizer_params, 0u);
  }
  if (placement.states == Tier::kDevice) {
    EXPECT_EQ(counters.optimizer_params, 0u);
  }
}

STRATA_INSTANTIATE_PLACEMENTS_ON_EACH_DEVICE(EngineEquivalenceTest);

// Ranks on one node share its memory and cores: the automatic host budget is divided among
// them, counted from the launcher's environment unless the trainer says; a set budget is kept.
TEST(EngineTest, RanksOnANodeShareTheAutomaticHostBudget) {
  const TinyModel model(kLayers, kWidth, kBatch);
  const auto specs = model.Specs();
  auto device = MakeDevice(64 << 20);
  EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, "");
  options.nvme.paths.clear();
  auto budget = [&](const EngineOptions& o, int ranks_on_node) -> uint64_t {
    auto engine = Engine::Create(o, *device, specs, {.ranks_on_node = ranks_on_node});
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    return engine.ok() ? (*engine)->tier_usage(Tier::kHost).budget_bytes : 0;
  };
  const uint64_t alone = budget(options, 1);
  EXPECT_EQ(budget(options, 4), alone / 4);
  EXPECT_EQ(budget(options, 0), alone);  // No launcher here.
  // Two torchrun ranks on this node.
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("LOCAL_WORLD_SIZE", "2", 1);
  EXPECT_EQ(budget(options, 0), alone / 2);
  EngineOptions set = options;
  set.host.pinned_memory_bytes = 256 << 20;
  EXPECT_EQ(budget(set, 0), uint64_t(256) << 20);
  // A launcher's variables that make no sense are the caller's error.
  setenv("LOCAL_RANK", "2", 1);
  auto bad = Engine::Create(options, *device, specs);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("LOCAL_RANK"), std::string::npos);
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) unsetenv(name);
}

// Automatic state staging takes the host budget that is left, but not the parameter staging
// buffers' share: with parameters on NVMe too, a budget a page short of 7 state buffers and
// the parameter pool gets 6 state buffers, not 7 and a failed Create.
TEST(EngineTest, AutomaticStateStagingLeavesRoomForTheParameterStaging) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);  // Six chunks: 7 buffers would be all.
  const auto specs = model.Specs();
  auto device = MakeDevice(64 << 20);
  EngineOptions options = MakeOptions({"nvme", Tier::kNvme, Tier::kNvme}, nvme.path());
  options.host.optimizer_buffer_count = 7;
  const uint64_t seven = std::move(Engine::Create(options, *device, specs))
                             .value()
                             ->tier_usage(Tier::kHost)
                             .used_bytes;
  options.host.optimizer_buffer_count = 0;  // Automatic.
  options.host.pinned_memory_bytes = seven - 4096;
  options.host.buffer_size = 4096;  // DeepSpeed's aio buffer, checked against the budget.
  auto engine = Engine::Create(options, *device, specs);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const uint64_t state_buffer = 5120 * 12;  // One fp32 chunk's master and moments.
  EXPECT_EQ((*engine)->tier_usage(Tier::kHost).used_bytes, seven - state_buffer);
}

TEST(EngineTest, StatesFillMaxStatesInHostAndSpillTheRestToNvme) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const auto specs = model.Specs();
  auto device = MakeDevice(64 << 20);
  const uint64_t chunk_states = 5120 * 12;  // One fp32 chunk's master and moments.
  struct NvmeTraffic {
    uint64_t writes = 0;     // Bytes written in steps 1..5 (each step's own, done by its end).
    uint64_t reads = 0;      // Bytes read over the same window (see below).
    uint64_t used = 0;       // NVMe bytes held.
    size_t nvme_chunks = 0;  // Chunks whose states live there.
  };
  const EngineOptions split = MakeOptions({"split", Tier::kNvme, Tier::kDevice}, nvme.path());
  auto traffic = [&](uint64_t states_in_host) {
    EngineOptions options = split;
    options.placement.max_states_in_host = states_in_host;
    auto engine = std::move(Engine::Create(options, *device, specs)).value();
    EngineTrainer trainer(*engine, model);
    double loss = 0.0;
    EXPECT_TRUE(trainer.TrainStep(0, &loss).ok());
    const EngineCounters before = engine->counters();
    for (int step = 1; step < 6; ++step) EXPECT_TRUE(trainer.TrainStep(step, &loss).ok());
    EngineCounters moved = engine->counters();
    moved -= before;
    NvmeTraffic t{.writes = moved.nvme_write_bytes,
                  .reads = moved.nvme_read_bytes,
                  .used = engine->tier_usage(Tier::kNvme).used_bytes};
    // The first chunks (backward reaches them last) are the ones kept in host memory.
    for (size_t c = 0; c < engine->chunk_count(); ++c) {
      const Tier expected = (c + 1) * chunk_states <= states_in_host ? Tier::kHost : Tier::kNvme;
      EXPECT_EQ(engine->placement(c).optimizer_states, expected) << "chunk " << c;
      t.nvme_chunks += expected == Tier::kNvme ? 1 : 0;
    }
    return t;
  };
  const NvmeTraffic all = traffic(0);
  // Three and a half chunks' worth: three whole chunks fit.
  const NvmeTraffic half = traffic(chunk_states * 7 / 2);
  ASSERT_EQ(all.nvme_chunks, 6u);
  ASSERT_EQ(half.nvme_chunks, 3u);
  // Each step writes every NVMe chunk's states once, within the step.
  EXPECT_EQ(all.writes, 5 * 6 * chunk_states);
  EXPECT_EQ(half.writes * 2, all.writes);
  EXPECT_EQ(half.used * 2, all.used);
  // Each step reads them once too, but the next step's first chunks are read ahead as soon as a
  // step commits, so a window between two steps may hold up to `depth` reads more or fewer.
  const uint64_t depth = split.host.optimizer_buffer_count - 1;
  for (const NvmeTraffic& t : {all, half}) {
    const uint64_t per_window = 5 * t.nvme_chunks * chunk_states;
    EXPECT_GE(t.reads + depth * chunk_states, per_window) << t.nvme_chunks << " chunks on NVMe";
    EXPECT_LE(t.reads, per_window + depth * chunk_states) << t.nvme_chunks << " chunks on NVMe";
  }
  // Everything in host: nothing left for NVMe to do.
  const NvmeTraffic none = traffic(6 * chunk_states);
  EXPECT_EQ(none.reads + none.writes + none.nvme_chunks, 0u);
}

TEST(EngineTest, AStateChunkTooLargeForMaxStatesInHostLeavesTheSmallerOnesThere) {
  // An embedding-like first parameter five chunks large, then small ones: with room for the
  // small chunks only, they stay in host memory (the big one goes to NVMe), and the NVMe
  // staging buffers are sized by what is on NVMe.
  ScratchDir nvme;
  std::vector<ParameterSpec> specs;
  specs.push_back({"embedding", {5 * 5120}, {}});
  for (int i = 0; i < 4; ++i) specs.push_back({"w" + std::to_string(i), {5120}, {}});
  const uint64_t small_states = 5120 * 12, big_states = 5 * small_states;
  auto device = MakeDevice(64 << 20);
  auto host_used = [&](uint64_t states_in_host) {
    EngineOptions options = MakeOptions({"split", Tier::kNvme, Tier::kDevice}, nvme.path());
    options.placement.max_states_in_host = states_in_host;
    auto engine = std::move(Engine::Create(options, *device, specs)).value();
    EXPECT_EQ(engine->chunk_count(), 5u);
    return std::make_pair(engine->tier_usage(Tier::kHost).used_bytes,
                          std::vector<Tier>{*engine->placement(0).optimizer_states,
                                            *engine->placement(1).optimizer_states,
                                            *engine->placement(4).optimizer_states});
  };
  const auto [all_nvme, all_tiers] = host_used(0);
  EXPECT_EQ(all_tiers, (std::vector<Tier>{Tier::kNvme, Tier::kNvme, Tier::kNvme}));
  // Room for the four small chunks, not the big one: they go to host, it to NVMe.
  const auto [small_in_host, small_tiers] = host_used(4 * small_states);
  EXPECT_EQ(small_tiers, (std::vector<Tier>{Tier::kNvme, Tier::kHost, Tier::kHost}));
  // Host memory grows by the four small chunks' states; the staging buffers stay as large as
  // the big chunk's, which still goes through them.
  EXPECT_EQ(small_in_host, all_nvme + 4 * small_states);
  // Room for the big one only: it is in host memory, and the staging buffers (3 of them here)
  // shrink to the small chunks' size.
  const auto [big_in_host, big_tiers] = host_used(big_states);
  EXPECT_EQ(big_tiers, (std::vector<Tier>{Tier::kHost, Tier::kNvme, Tier::kNvme}));
  EXPECT_EQ(big_in_host, all_nvme + big_states - 3 * (big_states - small_states));
}

/// What `options` take of host memory with everything placed there (as Create measures it);
/// then sets the host budget one byte short of it (and DeepSpeed's aio buffer below it).
uint64_t BudgetOneByteShortOfAllOnHost(EngineOptions& options, Device& device,
                                       std::span<const ParameterSpec> specs) {
  const uint64_t all_host =
      std::move(Engine::Create(options, device, specs)).value()->tier_usage(Tier::kHost).used_bytes;
  options.host.pinned_memory_bytes = all_host - 1;
  options.host.buffer_size = 4096;
  return all_host;
}

TEST(EngineTest, StatesOnHostSpillToNvmeWhenTheHostBudgetCannotHoldThem) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const auto specs = model.Specs();
  auto device = MakeDevice(64 << 20);
  EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, nvme.path());
  const uint64_t all_host = BudgetOneByteShortOfAllOnHost(options, *device, specs);
  std::vector<std::string> warnings;
  SetLogSink([&](LogLevel level, std::string_view message) {
    if (level == LogLevel::kWarning && message.find("optimizer states") != std::string::npos) {
      warnings.emplace_back(message);
    }
  });
  auto engine = Engine::Create(options, *device, specs);
  SetLogSink(nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  // The first chunks keep their states in host memory, the last ones spill, and it fits.
  std::vector<Tier> tiers;
  for (size_t c = 0; c < (*engine)->chunk_count(); ++c) {
    tiers.push_back(*(*engine)->placement(c).optimizer_states);
  }
  EXPECT_EQ(tiers.front(), Tier::kHost);
  EXPECT_EQ(tiers.back(), Tier::kNvme);
  EXPECT_TRUE(std::is_sorted(tiers.begin(), tiers.end())) << "not host first, then nvme";
  EXPECT_LE((*engine)->tier_usage(Tier::kHost).used_bytes, all_host - 1);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("spill to NVMe"), std::string::npos) << warnings[0];
  // Trained, it is the reference loop bit for bit.
  EngineTrainer trainer(**engine, model);
  ReferenceTrainer reference(model, options);
  for (int step = 0; step < 5; ++step) {
    double loss = 0.0;
    ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
    EXPECT_EQ(loss, reference.TrainStep(step));
  }
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()));
  EXPECT_GT((*engine)->counters().nvme_read_bytes, 0u);

  // Without NVMe to spill to, the budget is a clear error, as before.
  options.nvme.paths.clear();
  auto refused = Engine::Create(options, *device, specs);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
}

TEST(EngineTest, ASpillThatCannotFitChangesNothingAndSaysWhatDoesNotFit) {
  // More staging buffers than chunks: spilling frees less than the staging takes, so no
  // spill fits. The error is the host budget's, as without NVMe, and no swap file is made.
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const auto specs = model.Specs();
  auto device = MakeDevice(64 << 20);
  EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, nvme.path());
  options.host.optimizer_buffer_count = kLayers + 2;
  BudgetOneByteShortOfAllOnHost(options, *device, specs);
  auto refused = Engine::Create(options, *device, specs);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("the optimizer states of chunk"), std::string::npos)
      << refused.status().message();
  EXPECT_NE(refused.status().message().find("pinned_memory_bytes"), std::string::npos);
  EXPECT_TRUE(std::filesystem::is_empty(nvme.path())) << "a swap file was made";
}

TEST(EngineTest, ALargeLastChunkStaysInHostWhenSpillingSmallerOnesFits) {
  // An untied lm_head as the last chunk, eight chunks large: spilling it would need staging
  // buffers eight times as large. Spilling small chunks instead fits with fewer spilled.
  ScratchDir nvme;
  std::vector<ParameterSpec> specs;
  for (int i = 0; i < 12; ++i) specs.push_back({"w" + std::to_string(i), {5120}, {}});
  specs.push_back({"lm_head", {8 * 5120}, {}});
  auto device = MakeDevice(64 << 20);
  EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, nvme.path());
  const uint64_t all_host = BudgetOneByteShortOfAllOnHost(options, *device, specs);
  auto engine = Engine::Create(options, *device, specs);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_EQ((*engine)->chunk_count(), 13u);
  EXPECT_EQ((*engine)->placement(12).optimizer_states, Tier::kHost) << "lm_head spilled";
  // One small chunk's states buy room for its share of the staging buffers (3 here): four
  // spill, the last four small ones.
  for (size_t c = 0; c < 12; ++c) {
    EXPECT_EQ((*engine)->placement(c).optimizer_states, c >= 8 ? Tier::kNvme : Tier::kHost)
        << "chunk " << c;
  }
  EXPECT_LE((*engine)->tier_usage(Tier::kHost).peak_bytes, all_host - 1);
}

// The equivalence cases beyond placements (bf16, accumulation, clipping, fp16 overflow, resume
// across placements), on each device.
class EngineOnDeviceTest : public testing::OnDeviceTest {};
STRATA_INSTANTIATE_ON_EACH_DEVICE(EngineOnDeviceTest);

TEST_P(EngineOnDeviceTest, Bf16MatchesTheReferenceRoundedTheSameWay) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options =
      MakeOptions({"bf16", Tier::kNvme, Tier::kDevice}, nvme.path(), DType::kBf16);
  auto device = MakeDevice(64 << 20);
  ASSERT_NE(device, nullptr);
  auto engine = testing::MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  ReferenceTrainer reference(model, options);
  for (int step = 0; step < 30; ++step) {
    double loss = 0.0;
    ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
    EXPECT_EQ(loss, reference.TrainStep(step)) << "step " << step;
  }
  // bf16 working copies are rounded from the master by the kernel (nearest even) and by the
  // reference (Fp32ToBf16): the same numbers, so even bf16 agrees exactly.
  EXPECT_EQ(MaxAbsDiff(trainer.MasterParameters(), reference.master()), 0.0);
}

TEST_P(EngineOnDeviceTest, GradientAccumulationSumsEveryMicroStep) {
  for (Tier states : {Tier::kHost, Tier::kNvme, Tier::kDevice}) {
    if (!testing::RunsOn({"gas", states, Tier::kDevice}, device_kind())) continue;
    ScratchDir nvme;
    const TinyModel model(kLayers, kWidth, kBatch);
    EngineOptions options = MakeOptions({"gas", states, Tier::kDevice}, nvme.path());
    options.optimizer.gradient_accumulation_steps = 3;
    auto device = MakeDevice(64 << 20);
    ASSERT_NE(device, nullptr);
    auto engine = testing::MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model, 3);
    ReferenceTrainer reference(model, options);
    for (int step = 0; step < 8; ++step) {
      double loss = 0.0;
      ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
      EXPECT_EQ(loss, reference.TrainStep(step));
    }
    EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()))
        << TierName(states) << ": max |diff| "
        << MaxAbsDiff(trainer.MasterParameters(), reference.master());
  }
}

TEST_P(EngineOnDeviceTest, ClippingScalesByTheGlobalNorm) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  EngineOptions options = MakeOptions({"clip", Tier::kNvme, Tier::kDevice}, nvme.path());
  options.optimizer.gradient_clipping = 0.02;  // Below the gradients' norm: clipping is active.
  auto device = MakeDevice(64 << 20);
  ASSERT_NE(device, nullptr);
  auto engine = testing::MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  ReferenceTrainer reference(model, options);
  for (int step = 0; step < 10; ++step) {
    double loss = 0.0;
    Result<StepReport> report = trainer.TrainStep(step, &loss);
    ASSERT_TRUE(report.ok());
    EXPECT_GT(report->grad_norm, 0.02) << "the test needs clipping to be active";
    EXPECT_NEAR(loss, reference.TrainStep(step), 1e-6);
  }
  // The norm is summed per chunk in the engine and per parameter in the reference: the clip
  // coefficients may differ in the last bits.
  EXPECT_LT(MaxAbsDiff(trainer.MasterParameters(), reference.master()), 1e-6);
}

TEST_P(EngineOnDeviceTest, Fp16OverflowSkipsTheStepAndLowersTheScale) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  EngineOptions options =
      MakeOptions({"fp16", Tier::kHost, Tier::kDevice}, nvme.path(), DType::kFp16);
  options.precision.hysteresis = 1;
  auto device = MakeDevice(64 << 20);
  ASSERT_NE(device, nullptr);
  auto engine = testing::MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  ReferenceTrainer reference(model, options);
  EXPECT_EQ(engine->loss_scale(), 65536.0);

  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());
  reference.TrainStep(0);
  const auto before = trainer.MasterParameters();

  Result<StepReport> skipped = trainer.TrainStep(1, &loss, /*poison=*/true);
  ASSERT_TRUE(skipped.ok()) << skipped.status().ToString();
  EXPECT_TRUE(skipped->skipped);
  EXPECT_EQ(skipped->step, 1);
  EXPECT_EQ(skipped->loss_scale, 32768.0);
  EXPECT_EQ(engine->loss_scale(), 32768.0);
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), before)) << "a skipped step changed state";
  reference.TrainStep(1, /*skip=*/true);

  Result<StepReport> next = trainer.TrainStep(2, &loss);
  ASSERT_TRUE(next.ok());
  EXPECT_FALSE(next->skipped);
  EXPECT_EQ(next->step, 2);
  reference.TrainStep(2);
  // fp16 rounds the scaled gradients, the reference the unscaled ones: close, not identical.
  EXPECT_LT(MaxAbsDiff(trainer.MasterParameters(), reference.master()), 1e-4);
}

// Without a loss scaler nothing skips a step, but its report must not hide a non-finite
// gradient: the norm is NaN, as torch's clip_grad_norm_ returns a non-finite norm, rather than
// the finite chunks' norm, with clipping (gated) and without (ungated). The progress line then
// shows what the parameters took.
TEST(EngineTest, AFp32StepWithANonFiniteGradientReportsANaNNorm) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  for (const double clipping : {0.02, 0.0}) {
    SCOPED_TRACE("gradient_clipping " + std::to_string(clipping));
    EngineOptions options = MakeOptions({"clip", Tier::kHost, Tier::kDevice}, nvme.path());
    options.optimizer.gradient_clipping = clipping;
    auto device = MakeDevice(64 << 20);
    const auto specs = model.Specs();
    auto engine = std::move(Engine::Create(options, *device, specs)).value();
    EngineTrainer trainer(*engine, model);
    double loss = 0.0;
    Result<StepReport> poisoned = trainer.TrainStep(0, &loss, /*poison=*/true);
    ASSERT_TRUE(poisoned.ok()) << poisoned.status().ToString();
    EXPECT_FALSE(poisoned->skipped);
    EXPECT_TRUE(std::isnan(poisoned->grad_norm)) << "reported " << poisoned->grad_norm;
  }
}

TEST(EngineTest, NvmeFaultFailsTheStepAndLeavesStateIntactThenRetrySucceeds) {
  // A failed read or write, and a write into a full disk (swap space is reserved at Create, so
  // only a file system that allocates on overwrite can give that).
  for (auto [op, error] : {std::pair{nvme::IoOp::kRead, EIO}, std::pair{nvme::IoOp::kWrite, EIO},
                           std::pair{nvme::IoOp::kWrite, ENOSPC}}) {
    ScratchDir nvme;
    const TinyModel model(kLayers, kWidth, kBatch);
    const EngineOptions options = MakeOptions({"fault", Tier::kNvme, Tier::kDevice}, nvme.path());
    auto plan = std::make_shared<nvme::FaultPlan>();
    EngineEnvironment environment;
    environment.wrap_io_backend = [plan](std::unique_ptr<nvme::IoBackend> inner) {
      return nvme::CreateFaultInjectingBackend(std::move(inner), plan);
    };
    auto device = MakeDevice(64 << 20);
    const auto specs = model.Specs();
    auto engine =
        std::move(Engine::Create(options, *device, specs, std::move(environment))).value();
    EngineTrainer trainer(*engine, model);
    ReferenceTrainer reference(model, options);
    double loss = 0.0;
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
      reference.TrainStep(step);
    }
    const auto before = trainer.MasterParameters();

    // Fail one chunk's state read or write; others succeed first.
    plan->Add({.kind = nvme::FaultKind::kError, .op = op, .skip = 2, .times = 1, .error = error});
    Result<StepReport> failed = trainer.TrainStep(2, &loss);
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status().ToString();
    EXPECT_EQ(plan->fired(), 1);
    EXPECT_EQ(engine->step_count(), 2);
    EXPECT_TRUE(BitEqual(trainer.MasterParameters(), before)) << "a failed step changed state";

    // The gradients are still held: Step() again retries and matches the reference.
    Result<StepReport> retried = engine->Step().get();
    ASSERT_TRUE(retried.ok()) << retried.status().ToString();
    EXPECT_EQ(retried->step, 3);
    reference.TrainStep(2);
    EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()));
    ASSERT_TRUE(trainer.TrainStep(3, &loss).ok());
    EXPECT_EQ(loss, reference.TrainStep(3));
    EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()));
  }
}

TEST_P(EngineOnDeviceTest, ResumeFromACheckpointIsBitExactAcrossPlacements) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const std::string nvme_path = dir.path();
  const std::filesystem::path checkpoint = dir.path() / "ckpt";

  // Straight: 20 steps with states on host.
  const EngineOptions host_options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, nvme_path);
  auto device = MakeDevice(64 << 20);
  ASSERT_NE(device, nullptr);
  auto straight = testing::MakeEngine(host_options, *device, model);
  ASSERT_NE(straight, nullptr);
  EngineTrainer straight_trainer(*straight, model);
  std::vector<double> straight_losses;
  for (int step = 0; step < 20; ++step) {
    double loss = 0.0;
    ASSERT_TRUE(straight_trainer.TrainStep(step, &loss).ok());
    straight_losses.push_back(loss);
  }

  // Interrupted: 10 steps on host, save, resume on NVMe (with offloaded params) for 10 more.
  {
    auto first_device = MakeDevice(64 << 20);
    ASSERT_NE(first_device, nullptr);
    auto first = testing::MakeEngine(host_options, *first_device, model);
    ASSERT_NE(first, nullptr);
    EngineTrainer trainer(*first, model);
    for (int step = 0; step < 10; ++step) {
      double loss = 0.0;
      ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
    }
    size_t saved = 0;
    ASSERT_TRUE(first
                    ->Save(checkpoint, {.on_chunk_saved =
                                            [&](size_t done, size_t total) {
                                              saved = done;
                                              EXPECT_EQ(total, size_t(kLayers));
                                            }})
                    .ok());
    EXPECT_EQ(saved, size_t(kLayers));
  }
  const EngineOptions nvme_options =
      MakeOptions({"nvme", Tier::kNvme, Tier::kNvme, 1.0, 3 * kSlotBytes}, nvme_path);
  auto second_device = MakeDevice(3 * kSlotBytes);
  ASSERT_NE(second_device, nullptr);
  auto resumed = testing::MakeEngine(nvme_options, *second_device, model);
  ASSERT_NE(resumed, nullptr);
  Status loaded = resumed->Load(checkpoint);
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  EXPECT_EQ(resumed->step_count(), 10);
  EngineTrainer trainer(*resumed, model);
  for (int step = 10; step < 20; ++step) {
    double loss = 0.0;
    ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
    EXPECT_EQ(loss, straight_losses[step]) << "step " << step;
  }
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), straight_trainer.MasterParameters()));
}

TEST(EngineTest, CorruptedCheckpointIsDataLossAndChangesNothing) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const auto specs = model.Specs();
  const EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path());
  auto device = MakeDevice(64 << 20);
  auto engine = std::move(Engine::Create(options, *device, specs)).value();
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());
  ASSERT_TRUE(engine->Save(dir.path() / "ckpt").ok());
  ASSERT_TRUE(trainer.TrainStep(1, &loss).ok());
  const auto current = trainer.MasterParameters();

  const std::filesystem::path victim = dir.path() / "ckpt" / "chunk-000003.bin";
  {
    std::fstream file(victim, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(1000);
    file.put('\x5a');
  }
  Status loaded = engine->Load(dir.path() / "ckpt");
  EXPECT_EQ(loaded.code(), StatusCode::kDataLoss) << loaded.ToString();
  EXPECT_NE(loaded.message().find("chunk-000003.bin"), std::string::npos) << loaded.ToString();
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), current));
  EXPECT_EQ(engine->step_count(), 2);
}

TEST(EngineTest, TheLossScaleCarriesOverOnlyBetweenDynamicFp16Engines) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const auto specs = model.Specs();
  auto device = MakeDevice(64 << 20);
  const Placement host{"host", Tier::kHost, Tier::kDevice};
  auto options = [&](DType dtype, double static_scale, int initial_power) {
    EngineOptions o = MakeOptions(host, dir.path(), dtype);
    o.precision.loss_scale = static_scale;
    o.precision.initial_scale_power = initial_power;
    return o;
  };
  auto train_and_save = [&](const EngineOptions& o, const std::string& name) {
    auto engine = std::move(Engine::Create(o, *device, specs)).value();
    EngineTrainer trainer(*engine, model);
    double loss = 0.0;
    for (int step = 0; step < 2; ++step) ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
    ASSERT_TRUE(engine->Save(dir.path() / name).ok());
  };
  auto scale_after_loading = [&](const EngineOptions& o, const std::string& name) {
    auto engine = std::move(Engine::Create(o, *device, specs)).value();
    const Status loaded = engine->Load(dir.path() / name);
    EXPECT_TRUE(loaded.ok()) << loaded.ToString();
    EXPECT_EQ(engine->iteration_count(), 2) << name;
    return engine->loss_scale();
  };
  train_and_save(options(DType::kBf16, 0.0, 16), "bf16");
  train_and_save(options(DType::kFp16, 0.0, 10), "fp16-dynamic-1024");

  // fp16 from a bf16 checkpoint starts at its own initial scale, not bf16's 1.
  EXPECT_EQ(scale_after_loading(options(DType::kFp16, 0.0, 16), "bf16"), 65536.0);
  // Dynamic to dynamic continues the saved scale.
  EXPECT_EQ(scale_after_loading(options(DType::kFp16, 0.0, 16), "fp16-dynamic-1024"), 1024.0);
  // A static scale is the configuration's; bf16 has none.
  EXPECT_EQ(scale_after_loading(options(DType::kFp16, 128.0, 16), "fp16-dynamic-1024"), 128.0);
  EXPECT_EQ(scale_after_loading(options(DType::kBf16, 0.0, 16), "fp16-dynamic-1024"), 1.0);
}

TEST(EngineTest, CheckpointOfAnotherModelIsRejected) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const TinyModel other(kLayers, kWidth / 2, kBatch);
  const auto specs = model.Specs();
  const auto other_specs = other.Specs();
  const EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path());
  auto device = MakeDevice(64 << 20);
  {
    auto engine = std::move(Engine::Create(options, *device, other_specs)).value();
    ASSERT_TRUE(engine->Save(dir.path() / "ckpt").ok());
  }
  auto engine = std::move(Engine::Create(options, *device, specs)).value();
  Status loaded = engine->Load(dir.path() / "ckpt");
  EXPECT_EQ(loaded.code(), StatusCode::kInvalidArgument) << loaded.ToString();
  EXPECT_NE(loaded.message().find("layer0.weight"), std::string::npos) << loaded.ToString();
}

TEST(EngineDeathTest, ProcessKilledDuringSaveLeavesThePreviousCheckpointLoadable) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The dying save runs in a child that re-executes this test up to EXPECT_EXIT, so parent and
  // child must agree on the checkpoint's path: it is named after the parent's pid.
  const bool in_child = !GTEST_FLAG_GET(internal_run_death_test).empty();
  const std::filesystem::path dir =
      "/tmp/strata-engine-death-" + std::to_string(in_child ? getppid() : getpid());
  std::filesystem::create_directories(dir);
  const TinyModel model(kLayers, kWidth, kBatch);
  const auto specs = model.Specs();
  const std::filesystem::path checkpoint = dir / "ckpt";
  const EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir);
  auto device = MakeDevice(64 << 20);
  auto engine = std::move(Engine::Create(options, *device, specs)).value();
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());
  ASSERT_TRUE(engine->Save(checkpoint).ok());
  const auto saved = trainer.MasterParameters();

  ASSERT_TRUE(trainer.TrainStep(1, &loss).ok());
  EXPECT_EXIT(
      {
        // Dies with half of the new checkpoint written.
        Status s = engine->Save(checkpoint, {.on_chunk_saved = [](size_t done, size_t) {
                                  if (done == 3) _exit(42);
                                }});
        (void)s;
      },
      ::testing::ExitedWithCode(42), "");

  // The child left its half-written staging directory behind, next to the checkpoint.
  bool staging_left = false;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    staging_left |= entry.path().filename().string().starts_with("ckpt.tmp-");
  }
  EXPECT_TRUE(staging_left) << "the child did not get as far as writing the new checkpoint";
  ASSERT_TRUE(engine->Load(checkpoint).ok());
  EXPECT_EQ(engine->step_count(), 1);
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), saved));
  // The next save replaces the dead child's leftovers.
  ASSERT_TRUE(engine->Save(checkpoint).ok());
  engine.reset();
  std::filesystem::remove_all(dir);
}

TEST(EngineTest, BudgetsTooSmallAreClearErrorsAtCreate) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const auto specs = model.Specs();
  {
    auto device = MakeDevice(kSlotBytes / 2);
    auto engine =
        Engine::Create(MakeOptions({"tiny", Tier::kHost, Tier::kHost}, dir.path()), *device, specs);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(engine.status().message().find("one chunk"), std::string::npos)
        << engine.status().ToString();
  }
  {
    auto device = MakeDevice(2 * kSlotBytes);
    auto engine = Engine::Create(MakeOptions({"tiny", Tier::kHost, Tier::kDevice}, dir.path()),
                                 *device, specs);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(engine.status().message().find("offload the parameters"), std::string::npos)
        << engine.status().ToString();
  }
  {
    EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path());
    options.host.pinned_memory_bytes = 64 * 1024;
    options.host.buffer_size = 4096;
    auto device = MakeDevice(64 << 20);
    auto engine = Engine::Create(options, *device, specs);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(engine.status().message().find("host memory budget"), std::string::npos)
        << engine.status().ToString();
  }
  {
    auto device = MakeDevice(64 << 20);
    auto engine = Engine::Create(MakeOptions({"bad", Tier::kDevice, Tier::kHost}, dir.path()),
                                 *device, specs);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(EngineTest, MetricsShowInFlightWorkStallsAndRates) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options =
      MakeOptions({"metrics", Tier::kNvme, Tier::kNvme, 1.0, 3 * kSlotBytes}, nvme.path());
  // Every NVMe read takes 20 ms longer: the trainer stalls on parameter fetches and the
  // updates wait for their states, long enough to be seen.
  auto plan = std::make_shared<nvme::FaultPlan>();
  plan->Add({.kind = nvme::FaultKind::kDelay,
             .op = nvme::IoOp::kRead,
             .times = -1,
             .delay = std::chrono::milliseconds(20)});
  EngineEnvironment environment;
  environment.wrap_io_backend = [plan](std::unique_ptr<nvme::IoBackend> inner) {
    return nvme::CreateFaultInjectingBackend(std::move(inner), plan);
  };
  auto device = MakeDevice(3 * kSlotBytes);
  const auto specs = model.Specs();
  auto engine = std::move(Engine::Create(options, *device, specs, std::move(environment))).value();
  // Series by their rendered name, e.g. strata_inflight{resource="nvme_read"}; a series the
  // engine does not export is a failure, not a zero.
  auto series = [&](const std::string& name) {
    const std::string page = engine->metrics().RenderPrometheus();
    const size_t at = page.find("\n" + name + " ");
    if (at == std::string::npos) {
      ADD_FAILURE() << name << " is not exported";
      return -1.0;
    }
    return std::stod(page.substr(at + name.size() + 2));
  };
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());

  // The second step in the background; NVMe reads are seen in flight while it runs.
  auto running = std::async(std::launch::async, [&] { return trainer.TrainStep(1, &loss); });
  double most_reads_in_flight = 0.0;
  while (running.wait_for(std::chrono::milliseconds(1)) != std::future_status::ready) {
    most_reads_in_flight =
        std::max(most_reads_in_flight, series(R"(strata_inflight{resource="nvme_read"})"));
  }
  ASSERT_TRUE(running.get().ok());
  EXPECT_GE(most_reads_in_flight, 1.0);
  // Between steps only the next step's state preloads (NVMe reads) may be running.
  for (const char* resource : {"nvme_write", "host_to_device", "device_to_host", "cpu_optimizer"}) {
    EXPECT_EQ(series("strata_inflight{resource=\"" + std::string(resource) + "\"}"), 0.0)
        << resource;
  }

  // Acquire waited for chunks coming from NVMe (a delayed read each) and for every step; the
  // updates waited for their delayed state reads.
  auto stall = [&](const char* resource) {
    return series("strata_trainer_stall_seconds_total{resource=\"" + std::string(resource) + "\"}");
  };
  auto wait = [&](const char* resource) {
    return series("strata_update_wait_seconds_total{resource=\"" + std::string(resource) + "\"}");
  };
  EXPECT_GE(stall("nvme"), 0.02);
  EXPECT_EQ(stall("host_to_device"), 0.0);
  EXPECT_GT(stall("step"), 0.0);
  EXPECT_GE(wait("nvme_read"), 0.02);
  EXPECT_GT(wait("nvme_write"), 0.0);
  EXPECT_GT(wait("cpu_optimizer"), 0.0);

  // Rates over the last step: states and parameters went to NVMe, the optimizer ran.
  EXPECT_GT(series(R"(strata_tier_bandwidth_bytes_per_second{from="host",to="nvme"})"), 0.0);
  EXPECT_GT(series("strata_optimizer_params_per_second"), 0.0);
}

TEST(EngineTest, MisuseIsAClearError) {
  ScratchDir dir;
  const TinyModel model(2, kWidth, kBatch);
  const auto specs = model.Specs();
  auto device = MakeDevice(64 << 20);
  auto engine =
      std::move(Engine::Create(MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path()),
                               *device, specs))
          .value();
  EXPECT_EQ(engine->GradsReady(0).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->GradsReady(99).code(), StatusCode::kInvalidArgument);
  Result<StepReport> early = engine->Step().get();
  EXPECT_EQ(early.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(early.status().message().find("chunk 0"), std::string::npos);

  ASSERT_TRUE(engine->Acquire(0).ok());
  ASSERT_TRUE(engine->GradsReady(0).ok());
  EXPECT_EQ(engine->GradsReady(0).code(), StatusCode::kFailedPrecondition);
  engine->Release(0);
  EXPECT_EQ(engine->Save(dir.path() / "ckpt").code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace strata::offload
