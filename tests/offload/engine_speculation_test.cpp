// Speculative updates (OptimizerOptions::speculative_updates): with gradient clipping or fp16, a
// chunk is updated as soon as its gradients land, as if the step will neither clip nor
// overflow, and the verdict keeps or rolls the update back. Every result must equal the gated
// path's (every update waits for the global norm) bit for bit, in every placement, on steps
// that clip, steps that do not, steps that overflow and steps that fail and are retried.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine_test_support.h"
#include "strata/core/log.h"
#include "strata/nvme/fault_injection.h"
#include "support/scratch_dir.h"
#include "tiny_model.h"
#include "wrapped_device.h"

namespace strata::offload {
namespace {

using namespace std::chrono_literals;
using strata::testing::ScratchDir;
using testing::BitEqual;
using testing::DeviceUnderTest;
using testing::EngineTrainer;
using testing::kBatch;
using testing::kLayers;
using testing::kSlotBytes;
using testing::kWidth;
using testing::MakeDevice;
using testing::MakeEngine;
using testing::MakeOptions;
using testing::MaxAbsDiff;
using testing::Placement;
using testing::TinyModel;
using testing::WrappedDevice;

constexpr int kSteps = 12;

/// What kSteps steps of training gave.
struct Trajectory {
  std::vector<double> losses;
  std::vector<StepReport> reports;
  std::vector<std::vector<float>> master;
  EngineCounters counters;
  size_t speculative_chunks = 0;           // Chunks whose updates may run ahead of the verdict.
  std::vector<EngineCounters> after_step;  // The engine's counters after each step.
};

/// Chunks an engine can update ahead of the verdict: states on NVMe, or on host with a shadow
/// buffer (the tests' automatic host budget has room for every one).
/// Chunks whose states the host updates (on NVMe or in host memory): all of them, or only
/// `only` when given.
size_t SpeculativeChunks(const Engine& engine, std::optional<size_t> only = std::nullopt) {
  size_t n = 0;
  for (size_t c = 0; c < engine.chunk_count(); ++c) {
    if (only && c != *only) continue;
    const Tier states = *engine.placement(c).optimizer_states;
    n += states == Tier::kNvme || states == Tier::kHost ? 1 : 0;
  }
  return n;
}

/// For EngineTrainer::SetLateChunk: true once `condition` holds, or `at_most` after the first
/// call (the wait's start), whichever comes first.
std::function<bool()> WithinAtMost(std::chrono::milliseconds at_most,
                                   std::function<bool()> condition) {
  auto start = std::make_shared<std::optional<std::chrono::steady_clock::time_point>>();
  return [start, at_most, condition = std::move(condition)] {
    const auto now = std::chrono::steady_clock::now();
    if (!*start) *start = now;
    return condition() || now - **start >= at_most;
  };
}

/// Trains kSteps steps on a device of kind `on`; `poison_step` overflows that step's gradients
/// (fp16).
Trajectory Train(const EngineOptions& options, uint64_t device_budget, const TinyModel& model,
                 int poison_step = -1, DeviceUnderTest on = DeviceUnderTest::kHost) {
  Trajectory run;
  auto device = testing::MakeDeviceUnderTest(on, device_budget);
  if (device == nullptr) return run;
  auto engine = MakeEngine(options, *device, model);
  if (engine == nullptr) return run;
  run.speculative_chunks = SpeculativeChunks(*engine);
  // The chunks that update ahead of chunk 0's verdict (none on the gated path).
  const uint64_t others = !options.optimizer.speculative_updates
                              ? 0
                              : run.speculative_chunks - SpeculativeChunks(*engine, 0);
  EngineTrainer trainer(*engine, model);
  for (int step = 0; step < kSteps; ++step) {
    double loss = 0.0;
    // The poisoned chunk (0, which backward reaches last) lands once the others' updates have
    // started (2 s at most), so that there is something for the overflow to undo however the
    // threads run.
    const uint64_t ahead = engine->counters().speculative_updates;
    const Engine* e = engine.get();
    const bool wait = step == poison_step && others > 0;
    trainer.SetLateChunk(0, !wait ? std::function<bool()>() : WithinAtMost(2s, [e, ahead, others] {
                           return e->counters().speculative_updates >= ahead + others;
                         }));
    Result<StepReport> report = trainer.TrainStep(step, &loss, step == poison_step);
    EXPECT_TRUE(report.ok()) << "step " << step << ": " << report.status().ToString();
    if (!report.ok()) return run;
    run.losses.push_back(loss);
    run.reports.push_back(*report);
    run.after_step.push_back(engine->counters());
  }
  run.master = trainer.MasterParameters();
  run.counters = engine->counters();
  return run;
}

/// The two runs agree bit for bit: losses, norms, skips, scales and master parameters.
void ExpectSameBits(const Trajectory& gated, const Trajectory& speculative,
                    const std::string& what) {
  ASSERT_EQ(gated.reports.size(), speculative.reports.size()) << what;
  for (size_t s = 0; s < gated.reports.size(); ++s) {
    EXPECT_EQ(gated.losses[s], speculative.losses[s]) << what << ", step " << s;
    const StepReport& a = gated.reports[s];
    const StepReport& b = speculative.reports[s];
    EXPECT_EQ(a.skipped, b.skipped) << what << ", step " << s;
    EXPECT_EQ(a.loss_scale, b.loss_scale) << what << ", step " << s;
    if (!a.skipped) {
      EXPECT_EQ(a.grad_norm, b.grad_norm) << what << ", step " << s;
    }
  }
  EXPECT_TRUE(BitEqual(gated.master, speculative.master))
      << what << ": max |diff| " << MaxAbsDiff(gated.master, speculative.master);
}

int RolledBackSteps(const Trajectory& run) {
  return int(std::count_if(run.reports.begin(), run.reports.end(),
                           [](const StepReport& r) { return r.rolled_back; }));
}

class SpeculationTest : public testing::PlacementOnDeviceTest {};

TEST_P(SpeculationTest, ClippedAndUnclippedStepsEqualTheGatedPathBitForBit) {
  const Placement& placement = this->placement();
  const DeviceUnderTest on = device_kind();
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  EngineOptions options = MakeOptions(placement, nvme.path());

  // The norms of an unclipped run: a threshold at their median clips some steps, not all.
  options.optimizer.gradient_clipping = 1e9;
  options.optimizer.speculative_updates = false;
  const Trajectory unclipped = Train(options, placement.device_budget, model, -1, on);
  ASSERT_EQ(unclipped.reports.size(), size_t(kSteps));
  std::vector<double> norms;
  for (const StepReport& r : unclipped.reports) norms.push_back(r.grad_norm);
  std::sort(norms.begin(), norms.end());

  struct Threshold {
    const char* name;
    double max_norm;
  };
  for (const Threshold& t : {Threshold{"never clips", 1e9}, Threshold{"always clips", 1e-4},
                             Threshold{"clips some steps", norms[kSteps / 2]}}) {
    SCOPED_TRACE(t.name);
    options.optimizer.gradient_clipping = t.max_norm;
    options.optimizer.speculative_updates = false;
    const Trajectory gated = Train(options, placement.device_budget, model, -1, on);
    options.optimizer.speculative_updates = true;
    const Trajectory speculative = Train(options, placement.device_budget, model, -1, on);
    ExpectSameBits(gated, speculative, std::string(placement.name) + ", " + t.name);
    EXPECT_EQ(gated.counters.speculative_updates, 0u);

    const uint64_t n = speculative.speculative_chunks;
    const uint64_t ahead = speculative.counters.speculative_updates;
    const int rolled_back = RolledBackSteps(speculative);
    EXPECT_LE(ahead, kSteps * n);
    EXPECT_LE(speculative.counters.rolled_back_updates, ahead);
    if (t.max_norm == 1e9) {
      // Every speculative chunk but the one whose gradients land last (which makes the
      // verdict) is updated ahead of it, in every step, and every such update stands.
      EXPECT_GE(ahead, kSteps * (n > 0 ? n - 1 : 0));
      EXPECT_EQ(rolled_back, 0);
      EXPECT_EQ(speculative.counters.rolled_back_updates, 0u);
    } else if (t.max_norm == 1e-4) {
      // The first chunk to land already needs clipping: nothing is updated ahead, for nothing.
      EXPECT_EQ(ahead, 0u);
      EXPECT_EQ(rolled_back, 0);
    } else if (n >= 2) {
      // Steps near the threshold update their first chunks ahead, and roll them back when the
      // rest of the norm tips it over.
      EXPECT_GT(ahead, 0u);
      EXPECT_GT(rolled_back, 0);
      EXPECT_LT(rolled_back, kSteps);
    }
    // What a rolled-back step redoes shows in the optimizer's work, and only there.
    EXPECT_EQ(speculative.counters.optimizer_params,
              gated.counters.optimizer_params +
                  speculative.counters.rolled_back_updates * uint64_t(5120));
  }
}

STRATA_INSTANTIATE_PLACEMENTS_ON_EACH_DEVICE(SpeculationTest);

// fp16: the overflowing step undoes every update made ahead of the verdict and skips; the
// trajectory equals the gated path's bit for bit.
class SpeculationFp16Test : public testing::OnDeviceTest {};
STRATA_INSTANTIATE_ON_EACH_DEVICE(SpeculationFp16Test);

TEST_P(SpeculationFp16Test, AnOverflowUndoesTheUpdatesMadeAheadOfIt) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  for (const Placement& placement : {Placement{"host", Tier::kHost, Tier::kDevice},
                                     Placement{"nvme", Tier::kNvme, Tier::kDevice},
                                     Placement{"params_host", Tier::kHost, Tier::kHost}}) {
    SCOPED_TRACE(placement.name);
    EngineOptions options = MakeOptions(placement, nvme.path(), DType::kFp16);
    options.precision.hysteresis = 1;
    options.optimizer.speculative_updates = false;
    const Trajectory gated =
        Train(options, placement.device_budget, model, /*poison_step=*/3, device_kind());
    options.optimizer.speculative_updates = true;
    const Trajectory speculative =
        Train(options, placement.device_budget, model, /*poison_step=*/3, device_kind());
    ExpectSameBits(gated, speculative, placement.name);
    ASSERT_EQ(speculative.reports.size(), size_t(kSteps));
    EXPECT_TRUE(speculative.reports[3].skipped);
    EXPECT_TRUE(speculative.reports[3].rolled_back);
    EXPECT_EQ(RolledBackSteps(speculative), 1);
    // fp16 packs two layers per chunk: three chunks. Chunk 0 overflows and lands last, late: the
    // others update ahead of it, and all of those roll back.
    EXPECT_EQ(speculative.speculative_chunks, 3u);
    EngineCounters poisoned = speculative.after_step[3];
    poisoned -= speculative.after_step[2];
    EXPECT_EQ(poisoned.speculative_updates, 2u);
    EXPECT_EQ(poisoned.rolled_back_updates, poisoned.speculative_updates);
    EXPECT_EQ(speculative.counters.rolled_back_updates, poisoned.rolled_back_updates);
  }
}

// NVMe-kept chunks keep the parameters from before a speculative update, to put back on an
// overflow; without host budget for that they hold their upload back to the verdict. Both give
// the gated path's bits.
TEST(SpeculationFp16Test, AnOverflowPutsBackNvmeParametersWithOrWithoutRoomToKeepThem) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const Placement placement{"nvme", Tier::kNvme, Tier::kDevice};
  EngineOptions options = MakeOptions(placement, nvme.path(), DType::kFp16);
  options.precision.hysteresis = 1;
  options.host.buffer_size = 4096;  // Checked against small budgets; unused (no NVMe params).
  options.optimizer.speculative_updates = false;
  const Trajectory gated = Train(options, placement.device_budget, model, /*poison_step=*/3);
  // What the engine takes without them: a budget with no room left over.
  auto device = MakeDevice(placement.device_budget);
  auto measured = MakeEngine(options, *device, model);
  ASSERT_NE(measured, nullptr);
  const uint64_t used = measured->tier_usage(Tier::kHost).used_bytes;
  measured.reset();
  options.optimizer.speculative_updates = true;
  for (const uint64_t budget : {uint64_t(0), used}) {
    SCOPED_TRACE(budget == 0 ? "room to keep them" : "no room");
    options.host.pinned_memory_bytes = budget;
    const Trajectory speculative =
        Train(options, placement.device_budget, model, /*poison_step=*/3);
    ExpectSameBits(gated, speculative, budget == 0 ? "kept" : "held back");
    ASSERT_EQ(speculative.reports.size(), size_t(kSteps));
    EXPECT_TRUE(speculative.reports[3].rolled_back);
    EngineCounters poisoned = speculative.after_step[3];
    poisoned -= speculative.after_step[2];
    EXPECT_EQ(poisoned.rolled_back_updates, 2u);
  }
}

// A roll-back puts the device's parameters back before the chunk is open to a redo: Step(),
// called while a put-back waits for slow copies, finds the chunk still updated and leaves the
// redo to its journey (it once redid it at once, and the put-back then overwrote the redo's
// parameters: the device kept the old ones while the master moved on).
TEST(SpeculationTest, StepDuringARollBackLeavesTheRedoAfterThePutBack) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  for (const Placement& placement : {Placement{"host", Tier::kHost, Tier::kDevice},
                                     Placement{"nvme", Tier::kNvme, Tier::kDevice}}) {
    SCOPED_TRACE(placement.name);
    EngineOptions options = MakeOptions(placement, nvme.path());
    options.optimizer.gradient_clipping = 1e9;
    const Trajectory unclipped = Train(options, placement.device_budget, model);
    ASSERT_EQ(unclipped.reports.size(), size_t(kSteps));
    // Every step clips once its last chunk lands, after the others updated ahead.
    options.optimizer.gradient_clipping = 0.5 * unclipped.reports[0].grad_norm;
    options.optimizer.speculative_updates = false;
    const Trajectory gated = Train(options, placement.device_budget, model);
    options.optimizer.speculative_updates = true;
    // Uploads wait 40 ms each: the speculative one is still out when the verdict rolls the
    // chunk back, so its put-back waits for it, and Step() comes meanwhile.
    auto inner = MakeDevice(placement.device_budget);
    WrappedDevice device(*inner);
    device.DelayCopiesToDevice(40ms);
    auto engine = MakeEngine(options, device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    Trajectory slow;
    for (int step = 0; step < 4; ++step) {
      double loss = 0.0;
      ASSERT_TRUE(trainer.ForwardBackward(step, &loss).ok());
      // The verdict comes once chunk 0's gradients land (at once); Step() comes after it,
      // while the put-back waits behind the speculative upload.
      std::this_thread::sleep_for(15ms);
      Result<StepReport> report = engine->Step().get();
      ASSERT_TRUE(report.ok()) << report.status().ToString();
      slow.losses.push_back(loss);
      slow.reports.push_back(*report);
    }
    EXPECT_GT(engine->counters().rolled_back_updates, 0u);
    const std::vector<double> expected(gated.losses.begin(), gated.losses.begin() + 4);
    EXPECT_EQ(slow.losses, expected);
  }
}

// The point of it: with clipping on, updates run before the verdict can be made. Chunk 0's
// gradients are held back, so no global norm exists; the other chunks are updated anyway, and
// only with speculation.
TEST(SpeculationTest, UpdatesRunBeforeTheGlobalNormIsKnown) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  for (const Placement& placement : {Placement{"host", Tier::kHost, Tier::kDevice},
                                     Placement{"nvme", Tier::kNvme, Tier::kDevice}}) {
    for (const bool speculative : {false, true}) {
      SCOPED_TRACE(std::string(placement.name) + (speculative ? ", speculative" : ", gated"));
      EngineOptions options = MakeOptions(placement, nvme.path());
      options.optimizer.gradient_clipping = 1e9;
      options.optimizer.speculative_updates = speculative;
      auto device = MakeDevice(64 << 20);
      auto engine = MakeEngine(options, *device, model);
      ASSERT_NE(engine, nullptr);
      EngineTrainer trainer(*engine, model);
      std::vector<bool> unused(kLayers, false);
      unused[0] = true;
      trainer.SetUnusedChunks(unused);
      double loss = 0.0;
      ASSERT_TRUE(trainer.ForwardBackward(0, &loss).ok());
      const uint64_t expected = speculative ? uint64_t(kLayers - 1) * 5120 : 0;
      const auto deadline = std::chrono::steady_clock::now() + (speculative ? 10s : 200ms);
      while (engine->counters().optimizer_params < expected &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(1ms);
      }
      if (!speculative) std::this_thread::sleep_for(200ms);
      EXPECT_EQ(engine->counters().optimizer_params, expected);
      Result<StepReport> report = engine->Step().get();
      ASSERT_TRUE(report.ok()) << report.status().ToString();
      EXPECT_FALSE(report->rolled_back);
      EXPECT_EQ(engine->counters().optimizer_params, uint64_t(kLayers - 1) * 5120);
    }
  }
}

// Shadow buffers come out of what the host budget has left: none fit, and the chunks wait for the
// verdict (saying so); two fit, and the two whose gradients land first go ahead. Results are
// the same either way.
TEST(SpeculationTest, HostStatesSpeculateOnlyAsFarAsTheHostBudgetHoldsTheirShadows) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const Placement placement{"host", Tier::kHost, Tier::kDevice};
  EngineOptions options = MakeOptions(placement, nvme.path());
  options.optimizer.gradient_clipping = 1e9;  // Never clips: every speculation stands.
  options.optimizer.speculative_updates = false;
  const Trajectory gated = Train(options, placement.device_budget, model);
  // What the engine takes without shadow buffers, and one chunk's.
  auto device = MakeDevice(64 << 20);
  const uint64_t without = MakeEngine(options, *device, model)->tier_usage(Tier::kHost).used_bytes;
  const uint64_t shadow = 5120 * 12;
  options.optimizer.speculative_updates = true;

  std::vector<std::string> said;
  SetLogSink([&](LogLevel, std::string_view message) {
    if (message.find("speculative updates") != std::string_view::npos) said.emplace_back(message);
  });
  options.host.buffer_size = 4096;  // DeepSpeed's aio buffer, checked against the budget.
  options.host.pinned_memory_bytes = without;
  const Trajectory no_room = Train(options, placement.device_budget, model);
  options.host.pinned_memory_bytes = without + 2 * shadow + shadow / 2;
  const Trajectory two = Train(options, placement.device_budget, model);
  SetLogSink(nullptr);

  ExpectSameBits(gated, no_room, "no room");
  ExpectSameBits(gated, two, "room for two");
  EXPECT_EQ(no_room.counters.speculative_updates, 0u);
  // Chunks 5 and 4 each step, unless one of them is the last to land and makes the verdict.
  EXPECT_GE(two.counters.speculative_updates, uint64_t(kSteps));
  EXPECT_LE(two.counters.speculative_updates, uint64_t(2 * kSteps));
  EXPECT_EQ(two.counters.rolled_back_updates, 0u);
  ASSERT_EQ(said.size(), 2u);
  EXPECT_NE(said[0].find("0 of 6 chunks"), std::string::npos) << said[0];
  EXPECT_NE(said[1].find("2 of 6 chunks"), std::string::npos) << said[1];
}

// A step that fails after some chunks were updated ahead of the verdict (an NVMe write fails)
// is retried to the same result as the gated path's, clipped or not; host-kept states updated
// speculatively into their shadow are never left stepped for the retry to republish.
TEST(SpeculationTest, AFailedSpeculativeStepRetriesToTheGatedResult) {
  for (const bool clipped : {false, true}) {
    for (const Placement& placement :
         {Placement{"states_nvme", Tier::kNvme, Tier::kDevice},
          Placement{"params_nvme_states_host", Tier::kHost, Tier::kNvme, 1.0, 2 * kSlotBytes}}) {
      SCOPED_TRACE(std::string(placement.name) + (clipped ? ", clipped" : ", unclipped"));
      ScratchDir nvme;
      const TinyModel model(kLayers, kWidth, kBatch);
      EngineOptions options = MakeOptions(placement, nvme.path());
      options.optimizer.gradient_clipping = 1e9;
      options.optimizer.speculative_updates = false;
      if (clipped) {
        // Just under the failing step's norm: its first chunks update ahead, then roll back.
        const Trajectory unclipped = Train(options, placement.device_budget, model);
        ASSERT_EQ(unclipped.reports.size(), size_t(kSteps));
        options.optimizer.gradient_clipping = 0.9 * unclipped.reports[4].grad_norm;
      }
      const Trajectory gated = Train(options, placement.device_budget, model);

      options.optimizer.speculative_updates = true;
      auto plan = std::make_shared<nvme::FaultPlan>();
      EngineEnvironment environment;
      environment.wrap_io_backend = [plan](std::unique_ptr<nvme::IoBackend> inner) {
        return nvme::CreateFaultInjectingBackend(std::move(inner), plan);
      };
      auto device = MakeDevice(placement.device_budget);
      auto engine = MakeEngine(options, *device, model, std::move(environment));
      ASSERT_NE(engine, nullptr);
      EngineTrainer trainer(*engine, model);
      Trajectory retried;
      for (int step = 0; step < kSteps; ++step) {
        double loss = 0.0;
        // Step 4 fails one chunk's write, after others have been written.
        if (step == 4) {
          plan->Add({.kind = nvme::FaultKind::kError,
                     .op = nvme::IoOp::kWrite,
                     .skip = 2,
                     .times = 1,
                     .error = EIO});
        }
        Result<StepReport> report = trainer.TrainStep(step, &loss);
        if (step == 4) {
          ASSERT_FALSE(report.ok());
          EXPECT_EQ(plan->fired(), 1);
          report = engine->Step().get();
        }
        ASSERT_TRUE(report.ok()) << "step " << step << ": " << report.status().ToString();
        retried.losses.push_back(loss);
        retried.reports.push_back(*report);
      }
      retried.master = trainer.MasterParameters();
      ExpectSameBits(gated, retried, placement.name);
      EXPECT_GT(engine->counters().speculative_updates, 0u);
      if (clipped) {
        EXPECT_GT(engine->counters().rolled_back_updates, 0u);
      }
    }
  }
}

// A skipped fp16 step puts back the parameters the device held before its speculative
// uploads, even when that upload fails: the retry of the skipped step does it.
TEST(SpeculationFp16Test, ARetriedSkipPutsBackParametersWhoseRestoreUploadFailed) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const Placement placement{"host", Tier::kHost, Tier::kDevice};
  EngineOptions options = MakeOptions(placement, nvme.path(), DType::kFp16);
  options.precision.hysteresis = 1;
  options.optimizer.speculative_updates = false;
  const Trajectory gated = Train(options, placement.device_budget, model, /*poison_step=*/3);
  options.optimizer.speculative_updates = true;
  auto inner = MakeDevice(placement.device_budget);
  WrappedDevice device(*inner);
  auto engine = MakeEngine(options, device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  Trajectory retried;
  for (int step = 0; step < kSteps; ++step) {
    double loss = 0.0;
    // Chunk 2's speculative upload goes through; chunk 1's fails, and so does the upload that
    // puts chunk 2's parameters back when the overflow rolls it back.
    if (step == 3) device.FailCopiesToDevice(/*skip=*/1, /*times=*/2);
    // The poisoned chunk 0 lands late, once both speculative uploads were tried (one failed),
    // so that they come before the verdict. Each goes up when its update is done or, if the
    // trainer still held the chunk then, at its Release, which comes before chunk 0's
    // gradients: the wait ends on the failure (10 s is for a stalled run to fail, not to pass).
    trainer.SetLateChunk(0, step != 3 ? std::function<bool()>() : WithinAtMost(10s, [&device] {
                           return device.failed_copies() >= 1;
                         }));
    Result<StepReport> report = trainer.TrainStep(step, &loss, step == 3);
    if (step == 3) {
      ASSERT_FALSE(report.ok()) << "no upload made ahead of the verdict failed";
      EXPECT_GE(device.failed_copies(), 1);
      device.FailCopiesToDevice(0, 0);
      report = engine->Step().get();
      ASSERT_TRUE(report.ok()) << report.status().ToString();
      EXPECT_TRUE(report->skipped);
    }
    ASSERT_TRUE(report.ok()) << "step " << step << ": " << report.status().ToString();
    retried.losses.push_back(loss);
    retried.reports.push_back(*report);
  }
  retried.master = trainer.MasterParameters();
  ExpectSameBits(gated, retried, "restore upload failed");
}

// Whatever a failed step leaves, each device-home chunk's parameters are its master rounded
// (the old or the new one), never a speculative update that the verdict rolled back.
TEST(SpeculationTest, AFailedClippedStepLeavesNoRolledBackParametersOnTheDevice) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const Placement placement{"host", Tier::kHost, Tier::kDevice};
  EngineOptions options = MakeOptions(placement, nvme.path());
  // A threshold below step 2's norm but above what the first chunks' gradients alone reach: the
  // step clips, and chunks update ahead of the verdict.
  options.optimizer.gradient_clipping = 1e9;
  const Trajectory unclipped = Train(options, placement.device_budget, model);
  ASSERT_EQ(unclipped.reports.size(), size_t(kSteps));
  options.optimizer.gradient_clipping = 0.9 * unclipped.reports[2].grad_norm;

  auto inner = MakeDevice(placement.device_budget);
  WrappedDevice device(*inner);
  auto engine = MakeEngine(options, device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  for (int step = 0; step < 2; ++step) ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
  const uint64_t ahead = engine->counters().speculative_updates;
  // Chunk 5's speculative upload goes through, chunk 4's fails: the step fails, and the verdict
  // (a clip) rolls chunk 5 back without redoing it. Chunk 0 lands once both were tried (10 s at
  // most), so that the verdict (and any non-speculative upload) comes after them.
  device.FailCopiesToDevice(/*skip=*/1);
  // An update's parameters go up ahead of the verdict when it is done or, if the trainer still
  // held the chunk then, at its Release: both come before chunk 0 lands.
  bool failed_ahead = false;  // Whether the injected failure hit an upload made ahead.
  trainer.SetLateChunk(0, WithinAtMost(10s, [&device, &failed_ahead] {
                         return failed_ahead = device.failed_copies() >= 1;
                       }));
  Result<StepReport> failed = trainer.TrainStep(2, &loss);
  ASSERT_FALSE(failed.ok());
  ASSERT_GE(engine->counters().speculative_updates, ahead + 2) << "the test needs speculation";
  ASSERT_TRUE(failed_ahead) << "no upload made ahead of the verdict failed within 10 s";
  ASSERT_GE(engine->counters().rolled_back_updates, 1u) << "the test needs step 2 to clip";

  const ChunkLayout& layout = engine->layout();
  const std::vector<std::vector<float>> master = trainer.MasterParameters();
  for (size_t c = 0; c < engine->chunk_count(); ++c) {
    Result<ChunkView> view = engine->Acquire(c);
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    for (size_t p = 0; p < layout.parameter_count(); ++p) {
      const ParameterLocation& where = layout.location(p);
      if (where.chunk != c) continue;
      const float* on_device = static_cast<const float*>(view->params) + where.offset;
      EXPECT_EQ(std::memcmp(on_device, master[p].data(), where.numel * sizeof(float)), 0)
          << "chunk " << c << ", parameter " << p;
    }
    engine->Release(c);
  }
  // The retry finishes the step as the gated path would have.
  ASSERT_TRUE(engine->Step().get().ok());
}

// Every optimizer speculates, those with one state (Lion, Adagrad) included: their unused state
// is left alone by the update out of place as by the one in place.
TEST(SpeculationTest, EveryOptimizerEqualsTheGatedPathBitForBit) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  for (OptimizerType type : {OptimizerType::kAdam, OptimizerType::kAdagrad, OptimizerType::kLion}) {
    for (const Placement& placement : {Placement{"host", Tier::kHost, Tier::kDevice},
                                       Placement{"nvme", Tier::kNvme, Tier::kDevice}}) {
      const std::string what = std::string(OptimizerTypeName(type)) + ", " + placement.name;
      SCOPED_TRACE(what);
      EngineOptions options = MakeOptions(placement, nvme.path());
      options.optimizer.type = type;
      options.optimizer.lr = type == OptimizerType::kLion ? 1e-4 : 1e-2;
      options.optimizer.gradient_clipping = 1e9;
      options.optimizer.speculative_updates = false;
      const Trajectory gated = Train(options, placement.device_budget, model);
      options.optimizer.speculative_updates = true;
      auto device = MakeDevice(placement.device_budget);
      auto engine = MakeEngine(options, *device, model);
      ASSERT_NE(engine, nullptr);
      EngineTrainer trainer(*engine, model);
      Trajectory speculative;
      for (int step = 0; step < kSteps; ++step) {
        double loss = 0.0;
        Result<StepReport> report = trainer.TrainStep(step, &loss);
        ASSERT_TRUE(report.ok()) << "step " << step << ": " << report.status().ToString();
        speculative.losses.push_back(loss);
        speculative.reports.push_back(*report);
      }
      speculative.master = trainer.MasterParameters();
      ExpectSameBits(gated, speculative, what);
      EXPECT_GT(engine->counters().speculative_updates, 0u);
      // The state the optimizer does not use is still all zeros.
      const ParameterState unused =
          type == OptimizerType::kLion ? ParameterState::kExpAvgSq : ParameterState::kExpAvg;
      if (type != OptimizerType::kAdam) {
        std::vector<float> values(engine->layout().location(0).numel, 1.0f);
        ASSERT_TRUE(engine->ReadParameterState(0, unused, values).ok());
        EXPECT_EQ(values, std::vector<float>(values.size(), 0.0f));
      }
    }
  }
}

// A commit reads ahead the states of the chunks the next backward reaches first, so NVMe works
// while forward runs: as many as the staging buffers allow, less one. Automatic staging (the
// default, 0) has a buffer for every chunk and one more: the whole next step is read ahead.
TEST(SpeculationTest, TheCommitReadsAheadForTheNextBackward) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  for (const auto& [gated, buffers] : {std::pair{false, 3}, {true, 3}, {false, 0}, {true, 0}}) {
    SCOPED_TRACE(std::string(gated ? "gated" : "ungated") + ", optimizer_buffer_count " +
                 std::to_string(buffers));
    EngineOptions options = MakeOptions({"nvme", Tier::kNvme, Tier::kDevice}, nvme.path());
    options.optimizer.gradient_clipping = gated ? 1e9 : 0.0;
    options.host.optimizer_buffer_count = buffers;
    const uint64_t read_ahead = buffers > 0 ? uint64_t(buffers - 1) : kLayers;
    auto device = MakeDevice(64 << 20);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    double loss = 0.0;
    ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());
    // Each of the six chunks' states read once for the step (some of them ahead, at Create),
    // and the read-ahead of the next step's first ones, which may still be under way.
    const uint64_t chunk_states = 5120 * 12;
    const uint64_t expected = (kLayers + read_ahead) * chunk_states;
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (engine->counters().nvme_read_bytes < expected &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    std::this_thread::sleep_for(50ms);  // And nothing more.
    EXPECT_EQ(engine->counters().nvme_read_bytes, expected);
  }
}

}  // namespace
}  // namespace strata::offload
