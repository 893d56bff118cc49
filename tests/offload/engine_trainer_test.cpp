// What an outside trainer (PyTorch first) needs of the engine: ordering after work on a stream
// of its own, parameter groups, frozen parameters, chunks without gradients in a step, access
// to every optimizer state, and stated gradient semantics. Each against the in-memory reference
// loop.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "engine_test_support.h"
#include "strata/core/host_device.h"
#include "support/scratch_dir.h"
#include "tiny_model.h"
#include "wrapped_device.h"

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
using testing::WrappedDevice;
using namespace std::chrono_literals;

const Placement kPlacements[] = {
    {"states_host", Tier::kHost, Tier::kDevice},
    {"states_nvme", Tier::kNvme, Tier::kDevice},
    {"params_host", Tier::kHost, Tier::kHost, 1.0, 2 * kSlotBytes},
    {"params_nvme", Tier::kNvme, Tier::kNvme, 1.0, 3 * kSlotBytes},
    {"states_device", Tier::kDevice, Tier::kDevice},
};

// On each device: a HostStream beside a HostDevice, a CUDA stream of the trainer's own on a GPU.
class TrainerOnDeviceTest : public testing::OnDeviceTest {};
STRATA_INSTANTIATE_ON_EACH_DEVICE(TrainerOnDeviceTest);

// Gradients written late by work on the trainer's own stream, or on the device's compute
// stream (GradsReady without a stream), are the ones the engine copies: its copies and
// evictions wait for the stream named, not for another.
TEST_P(TrainerOnDeviceTest, CopiesWaitForWorkOnTheTrainersOwnStream) {
  for (const bool own_stream : {true, false}) {
    for (const Placement& placement : kPlacements) {
      if (!testing::RunsOn(placement, device_kind())) continue;
      SCOPED_TRACE(std::string(placement.name) + (own_stream ? ", own stream" : ", compute"));
      ScratchDir dir;
      const TinyModel model(kLayers, kWidth, kBatch);
      const EngineOptions options = MakeOptions(placement, dir.path());
      auto device = MakeDevice(placement.device_budget);
      ASSERT_NE(device, nullptr);
      auto engine = MakeEngine(options, *device, model);
      ASSERT_NE(engine, nullptr);
      Result<std::unique_ptr<testing::OutsideStream>> trainer_stream =
          testing::OutsideStream::Create(*device);
      ASSERT_TRUE(trainer_stream.ok()) << trainer_stream.status().ToString();
      EngineTrainer trainer(*engine, model);
      if (own_stream) {
        trainer.UseTrainerStream(trainer_stream->get(), 5ms);
      } else {
        trainer.DelayComputeStream(5ms);
      }
      ReferenceTrainer reference(model, options);
      for (int step = 0; step < 3; ++step) {
        double loss = 0.0;
        Result<StepReport> report = trainer.TrainStep(step, &loss);
        ASSERT_TRUE(report.ok()) << report.status().ToString();
        EXPECT_EQ(loss, reference.TrainStep(step)) << "step " << step;
      }
      EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()));
    }
  }
}

// An update that finishes while the trainer still holds its chunk (preempted between
// GradsReady and Release) sends its parameters to the device at the Release, not at the commit:
// they are there before Step() is called, as when the Release comes first.
TEST_P(TrainerOnDeviceTest, AnUpdateDoneBeforeItsChunksReleaseUploadsAtTheRelease) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const Placement& placement = kPlacements[1];  // Host-kept states, device-home parameters.
  ASSERT_TRUE(testing::RunsOn(placement, device_kind()));
  const EngineOptions options = MakeOptions(placement, dir.path());
  auto device = MakeDevice(placement.device_budget);
  ASSERT_NE(device, nullptr);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  const ChunkLayout& layout = engine->layout();
  const size_t last = layout.chunk_count() - 1;  // The first to get its gradients.
  ASSERT_GE(last, 1u);
  // Every chunk's new parameters but chunk 0's, which lands last.
  uint64_t uploads = 0;
  for (size_t c = 1; c <= last; ++c) {
    uploads += layout.chunk(c).numel * DTypeSize(engine->working_dtype());
  }
  EngineTrainer trainer(*engine, model);
  ReferenceTrainer reference(model, options);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const EngineCounters before = engine->counters();
    // The last chunk is held until its update is done, and a moment more, by when its journey
    // has found the chunk still held (without this fix, its parameters waited for the commit).
    trainer.SetHeldChunk(last, [&] {
      if (engine->counters().optimizer_params == before.optimizer_params) return false;
      std::this_thread::sleep_for(100ms);
      return true;
    });
    // Chunk 0 lands (and the step can commit) only once the others' parameters are up.
    bool uploaded = false;
    trainer.SetLateChunk(0, [&] {
      const EngineCounters now = engine->counters();
      return uploaded = now.host_to_device_bytes - before.host_to_device_bytes >= uploads;
    });
    double loss = 0.0;
    Result<StepReport> report = trainer.TrainStep(step, &loss);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ASSERT_TRUE(uploaded) << "the parameters of chunks 1.." << last
                          << " were not all on the device before Step()";
    EXPECT_EQ(loss, reference.TrainStep(step));
  }
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()));
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
    // trained model. (The step count is SetStepCount's: AnImportedOptimizerContinues... below.)
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

// A torch load_state_dict into a fresh engine: the states, then the step count (Adam's bias
// correction counts from it). Once both are in, the next step matches the original engine's bit
// for bit; bad counts and counts in the middle of a step are refused.
TEST(EngineTrainerTest, AnImportedOptimizerContinuesBitForBitOnceItsStepCountIsSet) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions({"nvme", Tier::kNvme, Tier::kDevice}, dir.path());
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  for (int step = 0; step < 3; ++step) ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());

  ScratchDir other_dir;
  const EngineOptions host = MakeOptions({"host", Tier::kHost, Tier::kDevice}, other_dir.path());
  auto other_device = MakeDevice(64 << 20);
  auto imported = MakeEngine(host, *other_device, model);
  ASSERT_NE(imported, nullptr);
  for (int kind = 0; kind < 3; ++kind) {
    for (size_t p = 0; p < model.parameter_count(); ++p) {
      std::vector<float> values(engine->layout().location(p).numel);
      ASSERT_TRUE(engine->ReadParameterState(p, ParameterState(kind), values).ok());
      ASSERT_TRUE(imported->WriteParameterState(p, ParameterState(kind), values).ok());
    }
  }
  EXPECT_EQ(imported->SetStepCount(-1).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(imported->SetStepCount(3).ok());
  EXPECT_EQ(imported->step_count(), 3);

  EngineTrainer imported_trainer(*imported, model);
  ASSERT_TRUE(imported_trainer.TrainStep(3, &loss).ok());
  ASSERT_TRUE(trainer.TrainStep(3, &loss).ok());
  EXPECT_EQ(imported->step_count(), 4);
  for (int kind = 0; kind < 3; ++kind) {
    for (size_t p = 0; p < model.parameter_count(); ++p) {
      std::vector<float> mine(engine->layout().location(p).numel);
      std::vector<float> theirs(mine.size());
      ASSERT_TRUE(engine->ReadParameterState(p, ParameterState(kind), mine).ok());
      ASSERT_TRUE(imported->ReadParameterState(p, ParameterState(kind), theirs).ok());
      EXPECT_TRUE(BitEqual({mine}, {theirs})) << "parameter " << p << " state " << kind;
    }
  }

  // Not in the middle of a step: the step's updates may already count from the old value.
  const size_t last = kLayers - 1;
  Result<ChunkView> view = imported->Acquire(last);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(imported->SetStepCount(0).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(imported->GradsReady(last).ok());
  imported->Release(last);
  EXPECT_EQ(imported->SetStepCount(0).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(imported->Step().get().ok());
  EXPECT_EQ(imported->step_count(), 5);
}

// A state_dict and a load_state_dict of a whole model in one call each: the same values as
// parameter by parameter, in every tier, and a bad entry anywhere changes nothing.
TEST(EngineTrainerTest, BatchedStateAccessMatchesParameterByParameter) {
  for (const Placement& placement : kPlacements) {
    ScratchDir dir;
    const TinyModel model(kLayers, kWidth, kBatch);
    const EngineOptions options = MakeOptions(placement, dir.path());
    auto device = MakeDevice(placement.device_budget);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    double loss = 0.0;
    for (int step = 0; step < 2; ++step) ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
    const size_t n = model.parameter_count();
    std::vector<std::vector<float>> batched(3 * n), single(3 * n);
    std::vector<ParameterStateRead> reads;
    for (size_t p = 0; p < n; ++p) {
      for (int kind = 0; kind < 3; ++kind) {
        const size_t numel = engine->layout().location(p).numel;
        batched[3 * p + kind].resize(numel);
        single[3 * p + kind].resize(numel);
        reads.push_back(
            {.parameter = p, .state = ParameterState(kind), .out = batched[3 * p + kind]});
        ASSERT_TRUE(engine->ReadParameterState(p, ParameterState(kind), single[3 * p + kind]).ok());
      }
    }
    ASSERT_TRUE(engine->ReadParameterStates(reads).ok());
    EXPECT_TRUE(BitEqual(batched, single)) << placement.name;

    // Write every state doubled, in one call; a bad last entry first changes nothing.
    std::vector<std::vector<float>> doubled = single;
    std::vector<ParameterStateWrite> writes;
    for (size_t i = 0; i < doubled.size(); ++i) {
      for (float& v : doubled[i]) v *= 2.0f;
      writes.push_back({.parameter = i / 3, .state = ParameterState(i % 3), .values = doubled[i]});
    }
    std::vector<ParameterStateWrite> bad = writes;
    const std::vector<float> short_values(3);
    bad.push_back({.parameter = 0, .state = ParameterState::kExpAvg, .values = short_values});
    EXPECT_EQ(engine->WriteParameterStates(bad).code(), StatusCode::kInvalidArgument);
    ASSERT_TRUE(engine->ReadParameterStates(reads).ok());
    EXPECT_TRUE(BitEqual(batched, single)) << placement.name << ": unchanged";
    ASSERT_TRUE(engine->WriteParameterStates(writes).ok());
    ASSERT_TRUE(engine->ReadParameterStates(reads).ok());
    EXPECT_TRUE(BitEqual(batched, doubled)) << placement.name;
    EXPECT_TRUE(BitEqual(trainer.MasterParameters(),
                         [&] {
                           std::vector<std::vector<float>> masters;
                           for (size_t p = 0; p < n; ++p) masters.push_back(doubled[3 * p]);
                           return masters;
                         }()))
        << placement.name;
  }
}

// A load_state_dict into NVMe-home states reads each chunk about once: the states in one pass,
// plus the read-ahead that the end of the call starts (not a read-ahead restarted per chunk).
TEST(EngineTrainerTest, BatchedWritesReadEachNvmeChunkAboutOnce) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  EngineOptions options = MakeOptions({"nvme", Tier::kNvme, Tier::kDevice}, dir.path());
  options.host.optimizer_buffer_count = 0;  // Automatic: every chunk's states read ahead.
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());
  std::vector<std::vector<float>> values;
  std::vector<ParameterStateWrite> writes;
  uint64_t all_states = 0;
  for (size_t c = 0; c < engine->chunk_count(); ++c) {
    all_states += ChunkStateBytes(engine->layout().chunk(c).numel);
  }
  for (size_t p = 0; p < model.parameter_count(); ++p) {
    values.emplace_back(engine->layout().location(p).numel, 0.5f);
  }
  for (size_t p = 0; p < model.parameter_count(); ++p) {
    writes.push_back({.parameter = p, .state = ParameterState::kExpAvg, .values = values[p]});
  }
  const uint64_t before = engine->counters().nvme_read_bytes;
  ASSERT_TRUE(engine->WriteParameterStates(writes).ok());
  ASSERT_TRUE(trainer.TrainStep(1, &loss).ok());  // Lets the read-ahead land.
  const uint64_t read = engine->counters().nvme_read_bytes - before;
  EXPECT_LE(read, 3 * all_states) << "one pass to write, one read-ahead, one step's reads";
}

// The step count stays within what a checkpoint can hold (Load's bound, 2^53).
TEST(EngineTrainerTest, AStepCountACheckpointCannotHoldIsRefused) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  auto device = MakeDevice(64 << 20);
  auto engine =
      MakeEngine(MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path()), *device, model);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->SetStepCount(int64_t{1} << 60).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(engine->SetStepCount(int64_t{1} << 53).ok());
}

// A chunk whose parameters live on the device keeps its memory for the engine's lifetime, so a
// trainer's tensors (PyTorch parameters and their .grad) may view it across steps; the engine's
// updates land in that same memory.
TEST_P(TrainerOnDeviceTest, DeviceHomeChunksKeepTheirMemoryAcrossSteps) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions({"nvme", Tier::kNvme, Tier::kDevice}, dir.path());
  auto device = MakeDevice(64 << 20);
  ASSERT_NE(device, nullptr);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  std::vector<ChunkView> first;
  for (size_t c = 0; c < engine->chunk_count(); ++c) {
    ASSERT_EQ(engine->placement(c).params, Tier::kDevice);
    Result<ChunkView> view = engine->Acquire(c);
    ASSERT_TRUE(view.ok());
    first.push_back(*view);
    engine->Release(c);
  }
  std::vector<float> before(8);
  ASSERT_TRUE(testing::ReadDeviceMemory(*device, first[0].params, before.data(), 8 * sizeof(float))
                  .ok());
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  for (int step = 0; step < 3; ++step) ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
  for (size_t c = 0; c < engine->chunk_count(); ++c) {
    Result<ChunkView> view = engine->Acquire(c);
    ASSERT_TRUE(view.ok());
    EXPECT_EQ(view->params, first[c].params) << "chunk " << c;
    EXPECT_EQ(view->grads, first[c].grads) << "chunk " << c;
    engine->Release(c);
  }
  std::vector<float> after(8);
  ASSERT_TRUE(
      testing::ReadDeviceMemory(*device, first[0].params, after.data(), 8 * sizeof(float)).ok());
  EXPECT_NE(before, after) << "the updates land in the memory the trainer views";
}

// Frozen layers (the first, as a frozen embedding, and one in the middle) are read by forward
// and backward but take no gradients, have no optimizer states and are never updated; the
// trained layers match the reference bit for bit in every placement.
TEST(EngineTrainerTest, FrozenParametersTakeNoGradientsAndAreNeverUpdated) {
  for (const Placement& placement : kPlacements) {
    ScratchDir dir;
    TinyModel model(kLayers, kWidth, kBatch);
    model.FreezeLayers({0, 3});
    const EngineOptions options = MakeOptions(placement, dir.path());
    auto device = MakeDevice(placement.device_budget);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    ASSERT_EQ(engine->chunk_count(), size_t(kLayers));
    EXPECT_FALSE(engine->placement(0).optimizer_states.has_value()) << placement.name;
    EXPECT_TRUE(engine->placement(1).optimizer_states.has_value()) << placement.name;

    Result<ChunkView> view = engine->Acquire(3);
    ASSERT_TRUE(view.ok()) << placement.name << ": " << view.status().ToString();
    EXPECT_NE(view->params, nullptr);
    EXPECT_EQ(view->grads, nullptr) << placement.name;
    const Status refused = engine->GradsReady(3);
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << placement.name;
    EXPECT_NE(refused.message().find("frozen"), std::string::npos) << refused.ToString();
    engine->Release(3);

    EngineTrainer trainer(*engine, model);
    ReferenceTrainer reference(model, options);
    for (int step = 0; step < 4; ++step) {
      double loss = 0.0;
      Result<StepReport> report = trainer.TrainStep(step, &loss);
      ASSERT_TRUE(report.ok()) << placement.name << ": " << report.status().ToString();
      EXPECT_EQ(loss, reference.TrainStep(step)) << placement.name << " step " << step;
    }
    const std::vector<std::vector<float>> master = trainer.MasterParameters();
    EXPECT_TRUE(BitEqual(master, reference.master())) << placement.name;
    for (size_t p : {size_t(0), size_t(1), size_t(6), size_t(7)}) {
      EXPECT_EQ(master[p], model.initial_values()[p]) << placement.name << " parameter " << p;
    }
    EXPECT_NE(master[2], model.initial_values()[2]) << "layer 1 trains";

    // Its "master" is its value; it has no moments to read or write.
    std::vector<float> values(engine->layout().location(0).numel);
    for (ParameterState moment : {ParameterState::kExpAvg, ParameterState::kExpAvgSq}) {
      EXPECT_EQ(engine->ReadParameterState(0, moment, values).code(),
                StatusCode::kFailedPrecondition);
      EXPECT_EQ(engine->WriteParameterState(0, moment, values).code(),
                StatusCode::kFailedPrecondition);
    }
    // Writing its value changes what forward reads.
    std::vector<float> doubled = model.initial_values()[0];
    for (float& v : doubled) v *= 2.0f;
    ASSERT_TRUE(engine->WriteParameterState(0, ParameterState::kMaster, doubled).ok());
    ASSERT_TRUE(engine->ReadParameterState(0, ParameterState::kMaster, values).ok());
    EXPECT_EQ(values, doubled) << placement.name;
    view = engine->Acquire(0);
    ASSERT_TRUE(view.ok());
    EXPECT_EQ(static_cast<const float*>(view->params)[5], doubled[5]) << placement.name;
    engine->Release(0);
  }
}

// A frozen chunk keeps only its working parameters: no states, no gradient buffers, and a
// resident copy half the size of a trained chunk's.
TEST(EngineTrainerTest, FrozenChunksTakeNoStateMemory) {
  const Placement placement{"params_host", Tier::kHost, Tier::kHost, 1.0, 2 * kSlotBytes};
  ScratchDir dir;
  const EngineOptions options = MakeOptions(placement, dir.path());
  TinyModel trained(kLayers, kWidth, kBatch);
  TinyModel frozen(kLayers, kWidth, kBatch);
  frozen.FreezeLayers({0, 1, 2});
  auto trained_device = MakeDevice(placement.device_budget);
  auto frozen_device = MakeDevice(placement.device_budget);
  auto with_states = MakeEngine(options, *trained_device, trained);
  auto without = MakeEngine(options, *frozen_device, frozen);
  ASSERT_NE(with_states, nullptr);
  ASSERT_NE(without, nullptr);
  // Per chunk of 5120 fp32: states 60 KiB, landing gradients 20 KiB, new parameters 20 KiB.
  const uint64_t per_chunk = 3 * 5120 * 4 + 5120 * 4 + 5120 * 4;
  EXPECT_EQ(
      with_states->tier_usage(Tier::kHost).used_bytes - without->tier_usage(Tier::kHost).used_bytes,
      3 * per_chunk);
  // Two trained chunks fill the device budget, or one and two frozen ones.
  for (size_t c : {size_t(0), size_t(1), size_t(3)}) {
    ASSERT_TRUE(without->Acquire(c).ok()) << "chunk " << c;
  }
  EXPECT_EQ(without->Acquire(2).status().code(), StatusCode::kResourceExhausted);
  for (size_t c : {size_t(0), size_t(1), size_t(3)}) without->Release(c);
}

// Checkpoints hold a frozen chunk's values. They load into the same model and continue bit for
// bit, and into a model frozen differently: unfreezing starts the moments at zero, freezing
// keeps the trained values.
TEST(EngineTrainerTest, FrozenChunksCheckpointAndLoadFrozenOrNot) {
  for (const Placement& placement : kPlacements) {
    ScratchDir dir;
    ScratchDir checkpoint;
    TinyModel model(kLayers, kWidth, kBatch);
    model.FreezeLayers({0, 3});
    const EngineOptions options = MakeOptions(placement, dir.path());
    auto device = MakeDevice(placement.device_budget);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    ReferenceTrainer reference(model, options);
    double loss = 0.0;
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE(trainer.TrainStep(step, &loss).ok()) << placement.name;
      reference.TrainStep(step);
    }
    ASSERT_TRUE(engine->Save(checkpoint.path() / "ckpt").ok()) << placement.name;

    // The same model, in a fresh engine: continues exactly.
    ScratchDir again_dir;
    auto again_device = MakeDevice(placement.device_budget);
    auto again = MakeEngine(MakeOptions(placement, again_dir.path()), *again_device, model);
    ASSERT_NE(again, nullptr);
    const Status loaded = again->Load(checkpoint.path() / "ckpt");
    ASSERT_TRUE(loaded.ok()) << placement.name << ": " << loaded.ToString();
    EngineTrainer again_trainer(*again, model);
    for (int step = 2; step < 4; ++step) {
      ASSERT_TRUE(again_trainer.TrainStep(step, &loss).ok()) << placement.name;
      EXPECT_EQ(loss, reference.TrainStep(step)) << placement.name << " step " << step;
    }
    EXPECT_TRUE(BitEqual(again_trainer.MasterParameters(), reference.master())) << placement.name;

    // Unfrozen: layer 0 starts from its saved value with zero moments; layer 1 keeps its
    // trained moments.
    TinyModel unfrozen(kLayers, kWidth, kBatch);
    ScratchDir unfrozen_dir;
    auto unfrozen_device = MakeDevice(placement.device_budget);
    auto thawed =
        MakeEngine(MakeOptions(placement, unfrozen_dir.path()), *unfrozen_device, unfrozen);
    ASSERT_NE(thawed, nullptr);
    ASSERT_TRUE(thawed->Load(checkpoint.path() / "ckpt").ok()) << placement.name;
    std::vector<float> values(thawed->layout().location(0).numel);
    ASSERT_TRUE(thawed->ReadParameterState(0, ParameterState::kMaster, values).ok());
    EXPECT_EQ(values, model.initial_values()[0]);
    ASSERT_TRUE(thawed->ReadParameterState(0, ParameterState::kExpAvg, values).ok());
    EXPECT_EQ(values, std::vector<float>(values.size(), 0.0f)) << placement.name;
    std::vector<float> layer1(thawed->layout().location(2).numel);
    ASSERT_TRUE(thawed->ReadParameterState(2, ParameterState::kExpAvg, layer1).ok());
    EXPECT_NE(layer1, std::vector<float>(layer1.size(), 0.0f)) << placement.name;
    EngineTrainer thawed_trainer(*thawed, unfrozen);
    ASSERT_TRUE(thawed_trainer.TrainStep(2, &loss).ok()) << placement.name;
    ASSERT_TRUE(thawed->ReadParameterState(0, ParameterState::kMaster, values).ok());
    EXPECT_NE(values, model.initial_values()[0]) << "layer 0 trains once unfrozen";

    // Frozen the other way: layer 1's trained value is what the frozen layer holds.
    TinyModel refrozen(kLayers, kWidth, kBatch);
    refrozen.FreezeLayers({1});
    ScratchDir refrozen_dir;
    auto refrozen_device = MakeDevice(placement.device_budget);
    auto frozen_again =
        MakeEngine(MakeOptions(placement, refrozen_dir.path()), *refrozen_device, refrozen);
    ASSERT_NE(frozen_again, nullptr);
    ASSERT_TRUE(frozen_again->Load(checkpoint.path() / "ckpt").ok()) << placement.name;
    ASSERT_TRUE(frozen_again->ReadParameterState(2, ParameterState::kMaster, layer1).ok());
    std::vector<float> saved(layer1.size());
    ASSERT_TRUE(again->Load(checkpoint.path() / "ckpt").ok());
    ASSERT_TRUE(again->ReadParameterState(2, ParameterState::kMaster, saved).ok());
    EXPECT_EQ(layer1, saved) << placement.name;
  }
}

// Frozen and trained parameters never share a chunk, so freezing part of a chunk changes the
// packing: Load says that is why, and how to move the states across.
TEST(EngineTrainerTest, LoadingAcrossAPackingThatFreezingChangedSaysWhy) {
  ScratchDir dir;
  std::vector<float> values(1000, 0.5f);
  std::vector<ParameterSpec> specs = {{.name = "a", .shape = {1000}, .initial_values = values},
                                      {.name = "b", .shape = {1000}, .initial_values = values}};
  const EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path());
  auto device = MakeDevice(64 << 20);
  auto trained = Engine::Create(options, *device, specs);
  ASSERT_TRUE(trained.ok());
  ASSERT_EQ((*trained)->chunk_count(), 1u);
  ASSERT_TRUE((*trained)->Save(dir.path() / "ckpt").ok());
  specs[0].frozen = true;
  auto frozen = Engine::Create(options, *device, specs);
  ASSERT_TRUE(frozen.ok());
  ASSERT_EQ((*frozen)->chunk_count(), 2u);
  const Status loaded = (*frozen)->Load(dir.path() / "ckpt");
  EXPECT_EQ(loaded.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(loaded.message().find("'a' trained then, frozen now"), std::string::npos)
      << loaded.ToString();
  EXPECT_NE(loaded.message().find("WriteParameterState"), std::string::npos);
}

// Every copy stays inside the device memory it was given, which (unlike HostDevice's) is not
// rounded up to pages: bf16 chunks of 2.5 pages, trained and frozen, through training, Save,
// Load and state access.
TEST(EngineTrainerTest, CopiesStayInsideTheirDeviceAllocations) {
  for (const Placement& placement : kPlacements) {
    ScratchDir dir;
    TinyModel model(kLayers, kWidth, kBatch);
    model.FreezeLayers({0});
    auto inner = MakeDevice(placement.device_budget);
    WrappedDevice device(*inner);
    device.CheckCopyBounds();
    auto engine = MakeEngine(MakeOptions(placement, dir.path(), DType::kBf16), device, model);
    ASSERT_NE(engine, nullptr) << placement.name;
    EngineTrainer trainer(*engine, model);
    double loss = 0.0;
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE(trainer.TrainStep(step, &loss).ok()) << placement.name;
    }
    ASSERT_TRUE(engine->Save(dir.path() / "ckpt").ok()) << placement.name;
    ASSERT_TRUE(engine->Load(dir.path() / "ckpt").ok()) << placement.name;
    for (size_t p : {size_t(0), size_t(2)}) {
      std::vector<float> master(engine->layout().location(p).numel);
      ASSERT_TRUE(engine->ReadParameterState(p, ParameterState::kMaster, master).ok());
      ASSERT_TRUE(engine->WriteParameterState(p, ParameterState::kMaster, master).ok());
    }
    ASSERT_TRUE(trainer.TrainStep(2, &loss).ok()) << placement.name;
    EXPECT_EQ(device.copies_out_of_bounds(), 0) << placement.name;
  }
}

// Staging for optimizer states is sized by the largest trained chunk: a frozen embedding far
// larger than the blocks costs no host memory when its parameters live on the device.
TEST(EngineTrainerTest, AFrozenEmbeddingDoesNotSizeTheStateStaging) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options =
      MakeOptions({"states_nvme", Tier::kNvme, Tier::kDevice}, dir.path());
  std::vector<ParameterSpec> with_embedding = model.Specs();
  with_embedding.insert(with_embedding.begin(),
                        {.name = "embed", .shape = {1024, 64}, .frozen = true});
  auto device = MakeDevice(64 << 20);
  auto without = MakeEngine(options, *device, model);
  ASSERT_NE(without, nullptr);
  auto engine = Engine::Create(options, *device, with_embedding);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_EQ((*engine)->tier_usage(Tier::kHost).used_bytes,
            without->tier_usage(Tier::kHost).used_bytes);
}

// With a frozen chunk in the model, a gated step (clipping) still updates the trained chunks
// during backward, before Step() is called: frozen chunks are never waited for.
TEST(EngineTrainerTest, AGatedStepWithFrozenChunksStillOverlapsBackward) {
  ScratchDir dir;
  TinyModel model(kLayers, kWidth, kBatch);
  model.FreezeLayers({0});
  EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path());
  options.optimizer.gradient_clipping = 0.02;
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.ForwardBackward(0, &loss).ok());
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (engine->counters().optimizer_params == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_GT(engine->counters().optimizer_params, 0u) << "no update ran before Step()";
  ASSERT_TRUE(engine->Step().get().ok());
}

// Frozen parameters never change, so their device copies outlive the step: a frozen backbone
// that fits is fetched once, the trained chunks after every step.
TEST(EngineTrainerTest, FrozenChunksStayOnTheDeviceAcrossSteps) {
  ScratchDir dir;
  TinyModel model(kLayers, kWidth, kBatch);
  model.FreezeLayers({0, 3});
  const EngineOptions options =
      MakeOptions({"params_host", Tier::kHost, Tier::kHost}, dir.path());  // 64 MiB: room.
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  for (int step = 0; step < 2; ++step) ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
  const uint64_t before = engine->counters().fetches;
  ASSERT_TRUE(trainer.TrainStep(2, &loss).ok());
  EXPECT_EQ(engine->counters().fetches - before, uint64_t(kLayers - 2));
}

// The fetch counters say where offloaded parameters came from and how many bytes: every fetch
// of a host-home chunk counts its working bytes as from host, of an NVMe-home one as from NVMe.
TEST(EngineTrainerTest, FetchedBytesAreCountedByTheTierTheyCameFrom) {
  for (const Placement& placement : kPlacements) {
    if (placement.params == Tier::kDevice) continue;
    SCOPED_TRACE(placement.name);
    ScratchDir dir;
    const TinyModel model(kLayers, kWidth, kBatch);
    const EngineOptions options = MakeOptions(placement, dir.path());
    auto device = MakeDevice(placement.device_budget);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    double loss = 0.0;
    for (int step = 0; step < 2; ++step) ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
    const EngineCounters counters = engine->counters();
    ASSERT_GT(counters.fetches, 0u);
    // Every chunk of TinyModel has the same size, so each fetch moves one chunk's bytes.
    const uint64_t chunk_bytes = engine->layout().chunk(0).numel * DTypeSize(engine->working_dtype());
    const uint64_t fetched = counters.fetches * chunk_bytes;
    EXPECT_EQ(counters.fetched_from_host_bytes, placement.params == Tier::kHost ? fetched : 0u);
    EXPECT_EQ(counters.fetched_from_nvme_bytes, placement.params == Tier::kNvme ? fetched : 0u);
    EXPECT_GE(counters.fetch_stall_seconds, 0.0);
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
