// optimizer.recheck_gradients: a trainer may change the gradients between GradsReady and Step()
// (PyTorch's clip_grad_norm_, GradScaler's unscale_, an edit through .data) and the step must be
// the one those changed gradients give, bit for bit, whatever the engine had already updated
// from the gradients as they were; a change by exactly nothing keeps every update made ahead.
// AbandonStep drops an open step as if its backward had not run.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "engine_test_support.h"
#include "strata/nvme/fault_injection.h"
#include "support/sanitizers.h"
#include "support/scratch_dir.h"
#include "tiny_model.h"

namespace strata::offload {
namespace {

using namespace std::chrono_literals;
using strata::testing::kUnderThreadSanitizer;
using strata::testing::ScratchDir;
using testing::BitEqual;
using testing::EngineTrainer;
using testing::kBatch;
using testing::kLayers;
using testing::kWidth;
using testing::MakeDevice;
using testing::MakeEngine;
using testing::MakeOptions;
using testing::MaxAbsDiff;
using testing::Placement;
using testing::TinyModel;

constexpr bool kHostAccessible = true;

// A trainer's edit after GradsReady races by design with the engine's reads of the same buffer
// ahead of Step() (the landing's measure, speculative updates): what those reads made is thrown
// away when Step()'s checksum differs. The tests wait for those reads to be done where they can
// see it, but not always (a clipping step stops speculating at a point they cannot see), so
// under ThreadSanitizer, which would report the race the feature is built around, they skip
// (kUnderThreadSanitizer).
constexpr int kSteps = 9;
constexpr float kClip = 0.37f;  // What the "trainer" multiplies gradients by.

/// Step by step, what the trainer does to which chunk's gradients after declaring them: every
/// third step scales all (a clip), then one multiplies all by exactly 1 (a clip that does not
/// clip), then one scales only chunk 1 (an edit of one layer's gradients).
float Edit(int step, size_t chunk) {
  switch (step % 3) {
    case 0: return kClip;
    case 1: return 1.0f;
    default: return chunk == 1 ? kClip : 1.0f;
  }
}

/// Chunks whose gradients Edit changes at `step`, of `chunks` trained ones.
int64_t Changed(int step, size_t chunks) {
  switch (step % 3) {
    case 0: return int64_t(chunks);
    case 1: return 0;
    default: return 1;
  }
}

/// The device-home placements (recheck_gradients needs the gradient buffers to stay put).
const Placement kDeviceHome[] = {
    {"states_device", Tier::kDevice, Tier::kDevice},
    {"states_host", Tier::kHost, Tier::kDevice},
    {"states_nvme", Tier::kNvme, Tier::kDevice},
    {"states_host_ratio_half", Tier::kHost, Tier::kDevice, 0.5},
    {"states_nvme_half_in_host", Tier::kNvme, Tier::kDevice, 1.0, 64 << 20, 3 * 5120 * 12},
};

struct RecheckCase {
  Placement placement;
  bool clip = false;  // The engine clips too (gradient_clipping), after the trainer's edit.
};

std::vector<RecheckCase> Cases() {
  std::vector<RecheckCase> cases;
  for (const Placement& p : kDeviceHome) {
    cases.push_back({p});
    cases.push_back({p, true});
  }
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<RecheckCase>& info) {
  return std::string(info.param.placement.name) + (info.param.clip ? "_clipped" : "");
}

/// `placement`'s options (MakeOptions) with optimizer.recheck_gradients on.
EngineOptions RecheckOptions(const Placement& placement, const std::string& nvme_path) {
  EngineOptions options = MakeOptions(placement, nvme_path);
  options.optimizer.recheck_gradients = true;
  return options;
}

/// Each chunk's gradient buffer: device-home chunks keep theirs for the engine's life, so a
/// trainer may hold on to it (PyTorch's .grad views it).
std::vector<float*> GradientBuffers(Engine& engine) {
  std::vector<float*> out;
  for (size_t c = 0; c < engine.chunk_count(); ++c) {
    Result<ChunkView> view = engine.Acquire(c);
    EXPECT_TRUE(view.ok()) << view.status().ToString();
    out.push_back(view.ok() ? static_cast<float*>(view->grads) : nullptr);
    engine.Release(c);
  }
  return out;
}

/// Waits (`at_most`) until the engine has updated `numel` more parameters than `before`: the
/// updates made ahead of Step() are done, so the edit that follows changes gradients they
/// already used.
void WaitForUpdates(const Engine& engine, uint64_t before, uint64_t numel,
                    std::chrono::milliseconds at_most) {
  const auto deadline = std::chrono::steady_clock::now() + at_most;
  while (engine.counters().optimizer_params < before + numel &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
}

class RecheckTest : public ::testing::TestWithParam<RecheckCase> {
 protected:
  EngineOptions Options(bool recheck) const {
    EngineOptions options = MakeOptions(GetParam().placement, nvme_.path());
    options.optimizer.recheck_gradients = recheck;
    // Small enough that some steps clip and some do not.
    if (GetParam().clip) options.optimizer.gradient_clipping = 0.05;
    return options;
  }

  ScratchDir nvme_;
  const TinyModel model_{kLayers, kWidth, kBatch};
};

// The reference writes the edited gradients before declaring them; the rechecked run declares
// the original ones, waits for the updates made ahead of Step() and edits them in place.
TEST_P(RecheckTest, EditsAfterGradsReadyGiveTheEditedGradientsStepBitForBit) {
  if (kUnderThreadSanitizer) GTEST_SKIP() << "the edit races with reads ahead, by design";
  auto reference_device = MakeDevice(GetParam().placement.device_budget, kHostAccessible);
  auto reference = MakeEngine(Options(false), *reference_device, model_);
  ASSERT_NE(reference, nullptr);
  EngineTrainer edited_first(*reference, model_);
  edited_first.SetGradientFactor(Edit);

  auto device = MakeDevice(GetParam().placement.device_budget, kHostAccessible);
  auto engine = MakeEngine(Options(true), *device, model_);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model_);
  const std::vector<float*> grads = GradientBuffers(*engine);
  uint64_t speculating = 0;  // Elements whose updates may run ahead of Step().
  for (size_t c = 0; c < engine->chunk_count(); ++c) {
    if (engine->placement(c).optimizer_states != Tier::kDevice) {
      speculating += engine->layout().chunk(c).numel;
    }
  }

  int64_t total_changed = 0;
  for (int step = 0; step < kSteps; ++step) {
    double expected_loss = 0.0;
    Result<StepReport> expected = edited_first.TrainStep(step, &expected_loss);
    ASSERT_TRUE(expected.ok()) << expected.status().ToString();

    const uint64_t before = engine->counters().optimizer_params;
    double loss = 0.0;
    ASSERT_TRUE(trainer.ForwardBackward(step, &loss).ok());
    // A clipping step stops speculating once the norm so far clips: then not all of them come.
    WaitForUpdates(*engine, before, speculating, GetParam().clip ? 100ms : 2000ms);
    for (size_t c = 0; c < engine->chunk_count(); ++c) {
      const float factor = Edit(step, c);
      for (size_t i = 0; i < engine->layout().chunk(c).numel; ++i) grads[c][i] *= factor;
    }
    Result<StepReport> report = engine->Step().get();
    ASSERT_TRUE(report.ok()) << "step " << step << ": " << report.status().ToString();

    EXPECT_EQ(loss, expected_loss) << "step " << step;
    EXPECT_EQ(report->grad_norm, expected->grad_norm) << "step " << step;
    // A chunk whose landing had not read its gradients before the edit (a device-kept chunk
    // measures in stream order, late) took the edited ones in the first place.
    const int64_t changed = Changed(step, engine->chunk_count());
    EXPECT_LE(report->changed_chunks, changed) << "step " << step;
    if (changed == 0) {
      EXPECT_EQ(report->changed_chunks, 0) << "step " << step;
    }
    total_changed += report->changed_chunks;
    const std::vector<std::vector<float>> master = trainer.MasterParameters();
    const std::vector<std::vector<float>> want = edited_first.MasterParameters();
    ASSERT_TRUE(BitEqual(master, want))
        << "step " << step << ": max |diff| " << MaxAbsDiff(master, want);
  }
  // Chunks that update ahead landed before the edit: their changes were seen and redone.
  if (speculating > 0) {
    EXPECT_GT(total_changed, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, RecheckTest, ::testing::ValuesIn(Cases()), CaseName);

// A multiplication by exactly 1 (a clip that does not clip) is no change: every update made
// ahead of Step() stands.
TEST(RecheckUnchangedTest, UnchangedGradientsKeepTheUpdatesMadeAhead) {
  if (kUnderThreadSanitizer) GTEST_SKIP() << "the edit races with reads ahead, by design";
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  for (const Placement& placement : kDeviceHome) {
    SCOPED_TRACE(placement.name);
    EngineOptions options = RecheckOptions(placement, nvme.path());
    auto device = MakeDevice(placement.device_budget, kHostAccessible);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    const std::vector<float*> grads = GradientBuffers(*engine);
    for (int step = 0; step < 4; ++step) {
      double loss = 0.0;
      ASSERT_TRUE(trainer.ForwardBackward(step, &loss).ok());
      for (size_t c = 0; c < engine->chunk_count(); ++c) {
        for (size_t i = 0; i < engine->layout().chunk(c).numel; ++i) grads[c][i] *= 1.0f;
      }
      Result<StepReport> report = engine->Step().get();
      ASSERT_TRUE(report.ok()) << report.status().ToString();
      EXPECT_EQ(report->changed_chunks, 0);
      EXPECT_FALSE(report->rolled_back);
    }
    EXPECT_EQ(engine->counters().rolled_back_updates, 0u);
  }
}

// AbandonStep, then the same micro-batch again: the run equals one that never had the first
// backward, and the abandoned step counts as nothing.
TEST(RecheckAbandonTest, AnAbandonedStepLeavesNoTrace) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  for (const Placement& placement : kDeviceHome) {
    SCOPED_TRACE(placement.name);
    EngineOptions options = RecheckOptions(placement, nvme.path());
    auto plain_device = MakeDevice(placement.device_budget, kHostAccessible);
    auto plain = MakeEngine(options, *plain_device, model);
    auto device = MakeDevice(placement.device_budget, kHostAccessible);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(plain, nullptr);
    ASSERT_NE(engine, nullptr);
    EngineTrainer plain_trainer(*plain, model);
    EngineTrainer trainer(*engine, model);
    for (int step = 0; step < 4; ++step) {
      double loss = 0.0;
      ASSERT_TRUE(plain_trainer.TrainStep(step, &loss).ok());
      if (step % 2 == 1) {
        // A skipped batch: backward of another micro-batch, dropped.
        ASSERT_TRUE(trainer.ForwardBackward(step + 100, &loss).ok());
        const uint64_t rolled_back = engine->counters().rolled_back_updates;
        ASSERT_TRUE(engine->AbandonStep().ok());
        EXPECT_EQ(engine->iteration_count(), step);
        EXPECT_EQ(engine->step_count(), step);
        EXPECT_GE(engine->counters().rolled_back_updates, rolled_back);
      }
      Result<StepReport> report = trainer.TrainStep(step, &loss);
      ASSERT_TRUE(report.ok()) << report.status().ToString();
      EXPECT_EQ(report->iteration, step + 1);
    }
    EXPECT_TRUE(BitEqual(trainer.MasterParameters(), plain_trainer.MasterParameters()))
        << "max |diff| "
        << MaxAbsDiff(trainer.MasterParameters(), plain_trainer.MasterParameters());
    // Nothing declared: nothing to drop.
    EXPECT_TRUE(engine->AbandonStep().ok());
  }
}

// An update made ahead of Step() that failed (an NVMe write) is dropped with the rest: the
// abandoned step still leaves no trace, and the run goes on as if it had never been.
TEST(RecheckAbandonTest, AFailedUpdateAheadIsAbandonedWithTheRest) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  EngineOptions options = RecheckOptions(kDeviceHome[2], nvme.path());  // States on NVMe.
  auto plain_device = MakeDevice(64 << 20, kHostAccessible);
  auto plain = MakeEngine(options, *plain_device, model);
  auto plan = std::make_shared<nvme::FaultPlan>();
  auto device = MakeDevice(64 << 20, kHostAccessible);
  auto engine = MakeEngine(options, *device, model, testing::FaultyNvme(plan));
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(engine, nullptr);
  EngineTrainer plain_trainer(*plain, model);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(plain_trainer.TrainStep(0, &loss).ok());
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());
  plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kWrite, .times = 1, .error = EIO});
  ASSERT_TRUE(trainer.ForwardBackward(100, &loss).ok());
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (plan->fired() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_EQ(plan->fired(), 1);
  const Status abandoned = engine->AbandonStep();
  ASSERT_TRUE(abandoned.ok()) << abandoned.ToString();
  EXPECT_EQ(engine->iteration_count(), 1);
  for (int step = 1; step < 4; ++step) {
    ASSERT_TRUE(plain_trainer.TrainStep(step, &loss).ok());
    Result<StepReport> report = trainer.TrainStep(step, &loss);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->iteration, step + 1);
    EXPECT_FALSE(report->skipped);
  }
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), plain_trainer.MasterParameters()));
}

// AbandonStep's refusals name it, not Step().
TEST(RecheckAbandonTest, ARefusedAbandonSaysAbandonStep) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  EngineOptions options = RecheckOptions(kDeviceHome[1], nvme.path());
  auto device = MakeDevice(64 << 20, kHostAccessible);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  trainer.SetUnusedChunks({true});  // Chunk 0 gets no gradients: the trainer may hold it.
  double loss = 0.0;
  ASSERT_TRUE(trainer.ForwardBackward(0, &loss).ok());
  ASSERT_TRUE(engine->Acquire(0).ok());
  const Status refused = engine->AbandonStep();
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.message().rfind("AbandonStep() while chunk 0 is acquired", 0), 0u)
      << refused.ToString();
  engine->Release(0);
  EXPECT_TRUE(engine->AbandonStep().ok());
}

TEST(RecheckAbandonTest, WithoutRecheckingAStepCannotBeAbandoned) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  EngineOptions options = MakeOptions(kDeviceHome[1], nvme.path());
  auto device = MakeDevice(64 << 20, kHostAccessible);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.ForwardBackward(0, &loss).ok());
  const Status abandoned = engine->AbandonStep();
  EXPECT_EQ(abandoned.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(abandoned.message().find("recheck_gradients"), std::string::npos)
      << abandoned.ToString();
  EXPECT_TRUE(engine->Step().get().ok());  // The step is still there to finish.
}

// What recheck_gradients needs is refused at Create, naming it.
TEST(RecheckPlacementTest, CreateRefusesWhatTheRecheckCannotRead) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const auto specs = model.Specs();
  struct Refusal {
    const char* what;
    std::function<void(EngineOptions&)> change;
    bool host_accessible;
    StatusCode code;
    const char* names;
  };
  const Refusal refusals[] = {
      {"a device the CPU does not read", [](EngineOptions&) {}, false, StatusCode::kUnavailable,
       "reads the trainer's gradient buffers on the CPU"},
      {"accumulation", [](EngineOptions& o) { o.optimizer.gradient_accumulation_steps = 2; }, true,
       StatusCode::kInvalidArgument, "gradient_accumulation_steps 1"},
      {"the delayed update", [](EngineOptions& o) { o.optimizer.delayed_update = true; }, true,
       StatusCode::kInvalidArgument, "delayed_update"},
      {"offloaded parameters", [](EngineOptions& o) { o.placement.params = Tier::kHost; }, true,
       StatusCode::kInvalidArgument, "placement.params"},
  };
  for (const Refusal& r : refusals) {
    SCOPED_TRACE(r.what);
    EngineOptions options = RecheckOptions(kDeviceHome[1], nvme.path());
    r.change(options);
    auto device = MakeDevice(64 << 20, r.host_accessible);
    Result<std::unique_ptr<Engine>> engine = Engine::Create(options, *device, specs);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), r.code) << engine.status().ToString();
    EXPECT_NE(engine.status().message().find(r.names), std::string::npos)
        << engine.status().ToString();
  }
}

}  // namespace
}  // namespace strata::offload
