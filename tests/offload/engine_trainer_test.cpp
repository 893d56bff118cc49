// What an outside trainer (PyTorch first) needs of the engine: ordering after work on a stream
// of its own, parameter groups, chunks without gradients in a step, access to every optimizer
// state, and stated gradient semantics. Each against the in-memory reference loop.
#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "engine_test_support.h"
#include "strata/core/host_device.h"
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
using testing::MakeEngine;
using testing::MakeOptions;
using testing::MaxAbsDiff;
using testing::Placement;
using testing::ReferenceTrainer;
using testing::TinyModel;
using namespace std::chrono_literals;

const Placement kPlacements[] = {
    {"states_host", Tier::kHost, Tier::kDevice},
    {"states_nvme", Tier::kNvme, Tier::kDevice},
    {"params_host", Tier::kHost, Tier::kHost, 1.0, 2 * kSlotBytes},
    {"params_nvme", Tier::kNvme, Tier::kNvme, 1.0, 3 * kSlotBytes},
    {"states_device", Tier::kDevice, Tier::kDevice},
};

// Gradients written late by work on the trainer's own stream are the ones the engine copies:
// its copies and evictions wait for that stream, not for Stream::kCompute.
TEST(EngineTrainerTest, CopiesWaitForWorkOnTheTrainersOwnStream) {
  for (const Placement& placement : kPlacements) {
    ScratchDir dir;
    const TinyModel model(kLayers, kWidth, kBatch);
    const EngineOptions options = MakeOptions(placement, dir.path());
    auto device = MakeDevice(placement.device_budget);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    HostStream trainer_stream;
    EngineTrainer trainer(*engine, model);
    trainer.UseTrainerStream(&trainer_stream, 5ms);
    ReferenceTrainer reference(model, options);
    for (int step = 0; step < 3; ++step) {
      double loss = 0.0;
      Result<StepReport> report = trainer.TrainStep(step, &loss);
      ASSERT_TRUE(report.ok()) << placement.name << ": " << report.status().ToString();
      EXPECT_EQ(loss, reference.TrainStep(step)) << placement.name << " step " << step;
    }
    EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master())) << placement.name;
  }
}

// Per-parameter weight decay and learning-rate scale (biases without decay, weights at half the
// rate), in every placement and through a schedule.
TEST(EngineTrainerTest, ParameterGroupsMatchTheReferenceBitForBit) {
  for (const Placement& placement : kPlacements) {
    ScratchDir dir;
    TinyModel model(kLayers, kWidth, kBatch);
    model.UseParameterGroups(/*weight_lr_scale=*/0.5);
    EngineOptions options = MakeOptions(placement, dir.path());
    options.optimizer.weight_decay = 0.1;
    auto device = MakeDevice(placement.device_budget);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    ReferenceTrainer reference(model, options);
    for (int step = 0; step < 6; ++step) {
      const double lr = 3e-3 * (1.0 - step / 10.0);  // A linear decay.
      engine->SetLearningRate(lr);
      reference.SetLearningRate(lr);
      double loss = 0.0;
      ASSERT_TRUE(trainer.TrainStep(step, &loss).ok()) << placement.name;
      EXPECT_EQ(loss, reference.TrainStep(step)) << placement.name << " step " << step;
    }
    EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()))
        << placement.name << ": max |diff| "
        << MaxAbsDiff(trainer.MasterParameters(), reference.master());
  }
}

TEST(EngineTrainerTest, BadParameterGroupsAreRejectedByName) {
  ScratchDir dir;
  const TinyModel model(2, kWidth, kBatch);
  auto specs = model.Specs();
  auto device = MakeDevice(64 << 20);
  const EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path());
  specs[1].lr_scale = 0.0;
  auto engine = Engine::Create(options, *device, specs);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("layer0.bias"), std::string::npos);
  specs[1].lr_scale = 1.0;
  specs[2].weight_decay = -1.0;
  engine = Engine::Create(options, *device, specs);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("layer1.weight"), std::string::npos);
}

// A chunk that gets no gradients in a step (an unused expert) is not updated and its bias
// correction does not advance, as torch skips a parameter whose .grad is None; the global norm
// of a clipped step is over the chunks that did get gradients.
TEST(EngineTrainerTest, ChunksWithoutGradientsInAStepAreLeftAlone) {
  for (double clipping : {0.0, 0.02}) {
    for (const Placement& placement : kPlacements) {
      ScratchDir dir;
      const TinyModel model(kLayers, kWidth, kBatch);
      EngineOptions options = MakeOptions(placement, dir.path());
      options.optimizer.gradient_clipping = clipping;
      auto device = MakeDevice(placement.device_budget);
      auto engine = MakeEngine(options, *device, model);
      ASSERT_NE(engine, nullptr);
      EngineTrainer trainer(*engine, model);
      ReferenceTrainer reference(model, options);
      for (int step = 0; step < 6; ++step) {
        // Chunk 2 (layer 2) is unused in steps 1 and 2, chunk 4 in step 3.
        std::vector<bool> unused_chunks(kLayers, false);
        if (step == 1 || step == 2) unused_chunks[2] = true;
        if (step == 3) unused_chunks[4] = true;
        std::vector<bool> unused_params(model.parameter_count(), false);
        for (int l = 0; l < kLayers; ++l) {
          unused_params[2 * l] = unused_params[2 * l + 1] = unused_chunks[l];
        }
        trainer.SetUnusedChunks(unused_chunks);
        double loss = 0.0;
        Result<StepReport> report = trainer.TrainStep(step, &loss);
        ASSERT_TRUE(report.ok()) << placement.name << ": " << report.status().ToString();
        EXPECT_EQ(report->step, step + 1);
        const double expected = reference.TrainStep(step, /*skip=*/false, unused_params);
        if (clipping == 0.0) {
          EXPECT_EQ(loss, expected) << placement.name << " step " << step;
        } else {
          EXPECT_NEAR(loss, expected, 1e-6) << placement.name << " step " << step;
        }
      }
      const double diff = MaxAbsDiff(trainer.MasterParameters(), reference.master());
      if (clipping == 0.0) {
        EXPECT_EQ(diff, 0.0) << placement.name;
      } else {
        EXPECT_LT(diff, 1e-6) << placement.name;
      }
    }
  }
}

TEST(EngineTrainerTest, AChunkWithGradientsInOnlySomeMicroStepsIsRefused) {
  ScratchDir dir;
  const TinyModel model(2, kWidth, kBatch);
  EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path());
  options.optimizer.gradient_accumulation_steps = 2;
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  for (size_t c : {size_t(1), size_t(0), size_t(1)}) {
    ASSERT_TRUE(engine->Acquire(c).ok());
    ASSERT_TRUE(engine->GradsReady(c).ok());
    engine->Release(c);
  }
  Result<StepReport> refused = engine->Step().get();
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("chunk 0 received the gradients of 1 of 2"),
            std::string::npos)
      << refused.status().ToString();
}

// Every optimizer state of every parameter can be read from any tier, and written back: an
// export from one engine imported into another (in another placement) continues bit for bit.
TEST(EngineTrainerTest, EveryStateCanBeReadAndWrittenInEveryTier) {
  for (const Placement& placement : kPlacements) {
    ScratchDir dir;
    const TinyModel model(kLayers, kWidth, kBatch);
    const EngineOptions options = MakeOptions(placement, dir.path());
    auto device = MakeDevice(placement.device_budget);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    ReferenceTrainer reference(model, options);
    double loss = 0.0;
    for (int step = 0; step < 3; ++step) {
      ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
      reference.TrainStep(step);
    }
    const std::vector<std::vector<float>>* expected[3] = {&reference.master(), &reference.exp_avg(),
                                                          &reference.exp_avg_sq()};
    std::vector<std::vector<std::vector<float>>> exported(3);
    for (int kind = 0; kind < 3; ++kind) {
      for (size_t p = 0; p < model.parameter_count(); ++p) {
        std::vector<float> values(engine->layout().location(p).numel);
        ASSERT_TRUE(engine->ReadParameterState(p, ParameterState(kind), values).ok());
        exported[kind].push_back(values);
      }
      EXPECT_TRUE(BitEqual(exported[kind], *expected[kind])) << placement.name << " kind " << kind;
    }

    // Into a fresh engine with the states on the host (a load_state_dict): it holds the same
    // states, and its working parameters were rewritten from the master, so forward sees the
    // trained model. (Its step count is a checkpoint's business, not a state's.)
    ScratchDir other_dir;
    const EngineOptions host = MakeOptions({"host", Tier::kHost, Tier::kDevice}, other_dir.path());
    auto other_device = MakeDevice(64 << 20);
    auto imported = MakeEngine(host, *other_device, model);
    ASSERT_NE(imported, nullptr);
    for (int kind = 0; kind < 3; ++kind) {
      for (size_t p = 0; p < model.parameter_count(); ++p) {
        ASSERT_TRUE(imported->WriteParameterState(p, ParameterState(kind), exported[kind][p]).ok());
      }
    }
    EngineTrainer imported_trainer(*imported, model);
    EXPECT_TRUE(BitEqual(imported_trainer.MasterParameters(), reference.master()));
    double first_loss = 0.0;
    ASSERT_TRUE(imported_trainer.ForwardBackward(3, &first_loss).ok());
    double reference_loss = 0.0;
    ASSERT_TRUE(trainer.ForwardBackward(3, &reference_loss).ok());
    EXPECT_EQ(first_loss, reference_loss) << placement.name;
    ASSERT_TRUE(imported->Step().get().ok());
    ASSERT_TRUE(engine->Step().get().ok());
    for (int kind = 0; kind < 3; ++kind) {
      std::vector<float> values(engine->layout().location(2).numel);
      ASSERT_TRUE(imported->ReadParameterState(2, ParameterState(kind), values).ok());
      EXPECT_FALSE(values == exported[kind][2]) << "the imported engine trained on";
    }

    // Bad writes change nothing and say why.
    std::vector<float> short_values(3);
    EXPECT_EQ(imported->WriteParameterState(0, ParameterState::kExpAvg, short_values).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(imported->WriteParameterState(99, ParameterState::kExpAvg, short_values).code(),
              StatusCode::kInvalidArgument);
    ASSERT_TRUE(imported->Acquire(0).ok());
    std::vector<float> values(engine->layout().location(0).numel);
    EXPECT_EQ(imported->WriteParameterState(0, ParameterState::kMaster, values).code(),
              StatusCode::kFailedPrecondition);
    imported->Release(0);
  }
}

// The engine reads view.grads as each micro-step's gradients and sums micro-steps itself. A
// fetched chunk's gradient buffer starts at zero; a device-home chunk's keeps what the trainer
// wrote last (so a trainer that accumulates into it must zero it per micro-step).
TEST(EngineTrainerTest, GradientBuffersHoldWhatTheTrainerWroteAndFetchesStartAtZero) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  for (const Placement& placement :
       {Placement{"device", Tier::kHost, Tier::kDevice},
        Placement{"fetched", Tier::kHost, Tier::kHost, 1.0, 2 * kSlotBytes}}) {
    EngineOptions options = MakeOptions(placement, dir.path());
    options.optimizer.gradient_accumulation_steps = 2;
    auto device = MakeDevice(placement.device_budget);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    const size_t c = kLayers - 1;
    Result<ChunkView> view = engine->Acquire(c);
    ASSERT_TRUE(view.ok());
    auto* grads = static_cast<float*>(view->grads);
    EXPECT_EQ(grads[0], 0.0f) << placement.name;
    grads[0] = 7.0f;
    ASSERT_TRUE(engine->GradsReady(c).ok());
    engine->Release(c);
    if (placement.params == Tier::kHost) {
      // Acquiring it again waits until its gradients have been copied out (and makes it the
      // most recently used); then two other chunks in a two-chunk budget evict it, and its
      // next fetch starts from zero.
      ASSERT_TRUE(engine->Acquire(c).ok());
      engine->Release(c);
      for (size_t other : {size_t(0), size_t(1)}) {
        ASSERT_TRUE(engine->Acquire(other).ok());
        engine->Release(other);
      }
    }
    view = engine->Acquire(c);
    ASSERT_TRUE(view.ok());
    EXPECT_EQ(static_cast<float*>(view->grads)[0], placement.params == Tier::kHost ? 0.0f : 7.0f)
        << placement.name;
    engine->Release(c);
  }
}

}  // namespace
}  // namespace strata::offload
