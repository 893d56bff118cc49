// optimizer.delayed_update (the ZeRO-Offload paper's DPU): a step's new parameters reach the
// device only once the next step is done with the old ones, so that step's forward and backward
// run beside this step's update. The trajectory must be the reference loop's with the same
// one-step delay, bit for bit in fp32, however the update and the next forward interleave.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <optional>

#include "engine_test_support.h"
#include "strata/offload/engine.h"
#include "support/scratch_dir.h"
#include "tiny_model.h"

namespace strata::offload {
namespace {

using namespace std::chrono_literals;
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
using testing::ReferenceTrainer;
using testing::TinyModel;

constexpr int kSteps = 8;
constexpr int kDelayFrom = 2;

const Placement kDelayable[] = {
    {"states_host", Tier::kHost, Tier::kDevice},
    {"states_nvme", Tier::kNvme, Tier::kDevice},
    {"states_nvme_half_in_host", Tier::kNvme, Tier::kDevice, 1.0, 64 << 20, 3 * 5120 * 12},
};

struct Setting {
  const char* name;
  double clipping = 0.0;
  DType dtype = DType::kFp32;
};

EngineOptions DelayedOptions(const Placement& placement, const std::string& nvme,
                             const Setting& setting) {
  EngineOptions options = MakeOptions(placement, nvme, setting.dtype);
  options.optimizer.delayed_update = true;
  options.optimizer.delayed_update_from_step = kDelayFrom;
  options.optimizer.gradient_clipping = setting.clipping;
  return options;
}

/// Trains kSteps through the engine. `overlapped`: each Step()'s future is waited for only after
/// the next step's forward and backward (whose first GradsReady waits for it), as a trainer that
/// overlaps them does; otherwise right away.
void TrainDelayed(Engine& engine, const TinyModel& model, bool overlapped,
                  std::vector<double>& losses) {
  EngineTrainer trainer(engine, model);
  std::optional<std::future<Result<StepReport>>> pending;
  for (int step = 0; step < kSteps; ++step) {
    double loss = 0.0;
    ASSERT_TRUE(trainer.ForwardBackward(step, &loss).ok()) << "step " << step;
    if (pending) {
      Result<StepReport> previous = pending->get();
      ASSERT_TRUE(previous.ok()) << previous.status().ToString();
      EXPECT_EQ(previous->step, step);
    }
    losses.push_back(loss);
    pending = engine.Step();
    if (!overlapped) {
      Result<StepReport> report = pending->get();
      ASSERT_TRUE(report.ok()) << report.status().ToString();
      pending.reset();
    }
  }
  if (pending) {
    ASSERT_TRUE(pending->get().ok());
  }
}

// The delayed trajectories, on each device.
class DelayedUpdateOnDeviceTest : public testing::OnDeviceTest {};
STRATA_INSTANTIATE_ON_EACH_DEVICE(DelayedUpdateOnDeviceTest);

TEST_P(DelayedUpdateOnDeviceTest, TrajectoryIsTheDelayedReferenceBitForBit) {
  const TinyModel model(kLayers, kWidth, kBatch);
  // A threshold between the steps' norms: some clip, some do not.
  for (const Setting& setting :
       {Setting{"fp32"}, Setting{"fp32 clipped", 0.5}, Setting{"bf16", 0.0, DType::kBf16}}) {
    for (const Placement& placement : kDelayable) {
      for (const bool overlapped : {false, true}) {
        SCOPED_TRACE(std::string(setting.name) + ", " + placement.name +
                     (overlapped ? ", overlapped" : ", waited for"));
        ScratchDir nvme;
        const EngineOptions options = DelayedOptions(placement, nvme.path(), setting);
        auto device = MakeDevice(64 << 20);
        ASSERT_NE(device, nullptr);
        auto engine = MakeEngine(options, *device, model);
        ASSERT_NE(engine, nullptr);
        std::vector<double> losses;
        TrainDelayed(*engine, model, overlapped, losses);
        ASSERT_EQ(losses.size(), size_t(kSteps));

        ReferenceTrainer delayed(model, options);
        EngineOptions exact_options = options;
        exact_options.optimizer.delayed_update = false;
        ReferenceTrainer exact(model, exact_options);
        for (int step = 0; step < kSteps; ++step) {
          EXPECT_EQ(losses[step], delayed.TrainStep(step)) << "step " << step;
          const double undelayed = exact.TrainStep(step);
          // Up to the first delayed step's successor, nothing differs; from then on it does.
          if (step <= kDelayFrom) {
            EXPECT_EQ(losses[step], undelayed) << "step " << step;
          } else {
            EXPECT_NE(losses[step], undelayed) << "step " << step;
          }
        }
        const auto master = EngineTrainer(*engine, model).MasterParameters();
        EXPECT_TRUE(BitEqual(master, delayed.master()))
            << "max |diff| " << MaxAbsDiff(master, delayed.master());
        EXPECT_FALSE(BitEqual(master, exact.master()));
      }
    }
  }
}

TEST_P(DelayedUpdateOnDeviceTest, AccumulationAndChunksThatSitStepsOutKeepTheDelay) {
  // Two micro-steps per step, and chunk 2 without gradients every other step: what it held back
  // goes up when Step() is called, its update waits for a step that has its gradients.
  const TinyModel model(kLayers, kWidth, kBatch);
  for (const Placement& placement : kDelayable) {
    SCOPED_TRACE(placement.name);
    ScratchDir nvme;
    EngineOptions options = DelayedOptions(placement, nvme.path(), {"fp32"});
    options.optimizer.gradient_accumulation_steps = 2;
    auto device = MakeDevice(64 << 20);
    ASSERT_NE(device, nullptr);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model, /*gradient_accumulation_steps=*/2);
    ReferenceTrainer reference(model, options);
    std::optional<std::future<Result<StepReport>>> running;
    for (int step = 0; step < kSteps; ++step) {
      std::vector<bool> unused_chunks(kLayers, false);
      std::vector<bool> unused_params(model.parameter_count(), false);
      if (step % 2 == 1) unused_chunks[2] = unused_params[4] = unused_params[5] = true;
      trainer.SetUnusedChunks(unused_chunks);
      double loss = 0.0;
      ASSERT_TRUE(trainer.ForwardBackward(step, &loss).ok()) << "step " << step;
      if (running) {
        ASSERT_TRUE(running->get().ok());
      }
      running = engine->Step();
      EXPECT_EQ(loss, reference.TrainStep(step, /*skip=*/false, unused_params)) << "step " << step;
    }
    ASSERT_TRUE(running->get().ok());
    const auto master = EngineTrainer(*engine, model).MasterParameters();
    EXPECT_TRUE(BitEqual(master, reference.master()))
        << "max |diff| " << MaxAbsDiff(master, reference.master());
  }
}

TEST(DelayedUpdateTest, TheNextForwardRunsWhileTheStepUpdates) {
  // A slow optimizer thread count would do; instead the step is observed from the trainer: the
  // next step's Acquire succeeds while Step()'s future is still pending, and its GradsReady
  // completes only after the future.
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options =
      DelayedOptions({"states_nvme", Tier::kNvme, Tier::kDevice}, nvme.path(), {"fp32"});
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  for (int step = 0; step < kDelayFrom; ++step) {
    ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
  }
  ASSERT_TRUE(trainer.ForwardBackward(kDelayFrom, &loss).ok());
  std::future<Result<StepReport>> pending = engine->Step();
  // Forward of the next step: allowed at once, finished or not.
  for (size_t c = 0; c < engine->chunk_count(); ++c) {
    ASSERT_TRUE(engine->Acquire(c).ok()) << "chunk " << c;
    engine->Release(c);
  }
  // Reading the master is not: the update may be writing it (until the future is ready).
  if (pending.wait_for(0s) != std::future_status::ready) {
    std::vector<float> values(engine->layout().location(0).numel);
    const Status read = engine->ReadMasterParameter(0, values);
    if (pending.wait_for(0s) != std::future_status::ready) {
      EXPECT_EQ(read.code(), StatusCode::kFailedPrecondition) << read.ToString();
    }
  }
  // The next step's gradients land only after it, whatever the timing.
  ASSERT_TRUE(trainer.ForwardBackward(kDelayFrom + 1, &loss).ok());
  EXPECT_EQ(pending.wait_for(0s), std::future_status::ready);
  Result<StepReport> report = pending.get();
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->step, kDelayFrom + 1);
  ASSERT_TRUE(engine->Step().get().ok());
}

// Saving, or writing a state, between steps sends what a delayed step held back to the device
// first, for every chunk: a run resumed from the checkpoint continues exactly as the run that
// saved it, and no forward sees some chunks one update newer than the others.
TEST(DelayedUpdateTest, SaveAndWritesBringEveryChunkUpToDateAlike) {
  const TinyModel model(kLayers, kWidth, kBatch);
  ScratchDir nvme, checkpoint;
  const EngineOptions options =
      DelayedOptions({"states_nvme", Tier::kNvme, Tier::kDevice}, nvme.path(), {"fp32"});
  constexpr int kBefore = 5, kAfter = 3;
  struct Run {
    std::vector<double> losses;
    std::vector<std::vector<float>> master;
  };
  // `between` runs after step kBefore - 1 (a delayed one) completes.
  auto train = [&](const std::function<void(std::unique_ptr<Engine>&, Device&)>& between) {
    Run run;
    auto device = MakeDevice(64 << 20);
    auto engine = MakeEngine(options, *device, model);
    EXPECT_NE(engine, nullptr);
    if (!engine) return run;
    for (int step = 0; step < kBefore + kAfter; ++step) {
      if (step == kBefore) between(engine, *device);
      EngineTrainer trainer(*engine, model);
      double loss = 0.0;
      EXPECT_TRUE(trainer.TrainStep(step, &loss).ok()) << "step " << step;
      run.losses.push_back(loss);
    }
    run.master = EngineTrainer(*engine, model).MasterParameters();
    return run;
  };
  const Run saved = train([&](std::unique_ptr<Engine>& engine, Device&) {
    ASSERT_TRUE(engine->Save(checkpoint.path()).ok());
  });
  const Run resumed = train([&](std::unique_ptr<Engine>& engine, Device& device) {
    auto fresh = MakeEngine(options, device, model);
    ASSERT_NE(fresh, nullptr);
    engine.reset();
    ASSERT_TRUE(fresh->Load(checkpoint.path()).ok());
    engine = std::move(fresh);
  });
  EXPECT_EQ(saved.losses, resumed.losses);
  EXPECT_TRUE(BitEqual(saved.master, resumed.master));
  // Writing back one parameter's moment unchanged acts on the parameters as Save does.
  const Run written = train([&](std::unique_ptr<Engine>& engine, Device&) {
    std::vector<float> moment(engine->layout().location(0).numel);
    ASSERT_TRUE(engine->ReadParameterState(0, ParameterState::kExpAvg, moment).ok());
    ASSERT_TRUE(engine->WriteParameterState(0, ParameterState::kExpAvg, moment).ok());
  });
  EXPECT_EQ(written.losses, saved.losses);
  EXPECT_TRUE(BitEqual(written.master, saved.master));
}

TEST(DelayedUpdateTest, IsRefusedWhereParametersCannotBeHeldBack) {
  ScratchDir nvme;
  const TinyModel model(kLayers, kWidth, kBatch);
  auto device = MakeDevice(64 << 20);
  const auto specs = model.Specs();
  auto refused = [&](const Placement& placement, const std::string& expected) {
    EngineOptions options = DelayedOptions(placement, nvme.path(), {"fp32"});
    auto engine = Engine::Create(options, *device, specs);
    ASSERT_FALSE(engine.ok()) << placement.name;
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find("optimizer.delayed_update"), std::string::npos);
    EXPECT_NE(engine.status().message().find(expected), std::string::npos)
        << engine.status().ToString();
  };
  refused({"params_host", Tier::kHost, Tier::kHost}, "placement.params");
  refused({"states_host_ratio_half", Tier::kHost, Tier::kDevice, 0.5}, "offload_ratio");
  refused({"states_device", Tier::kDevice, Tier::kDevice}, "offload_ratio");

  // fp16's dynamic loss scale: the next backward's scale waits on this step's verdict.
  EngineOptions fp16 = DelayedOptions({"states_host", Tier::kHost, Tier::kDevice}, nvme.path(),
                                      {"fp16", 0.0, DType::kFp16});
  const Status invalid = fp16.Validate();
  EXPECT_EQ(invalid.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(invalid.message().find("precision.loss_scale"), std::string::npos)
      << invalid.ToString();
  fp16.precision.loss_scale = 1024.0;  // A fixed scale is known ahead.
  EXPECT_TRUE(fp16.Validate().ok()) << fp16.Validate().ToString();
}

}  // namespace
}  // namespace strata::offload
