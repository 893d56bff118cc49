// Sharded checkpoints: every rank saves its shards into one checkpoint that appears whole or not
// at all, and a checkpoint loads into any world size (2 -> 1, 1 -> 2, 2 -> 3), continuing the
// run it came from. The gradients are small multiples of 2^-8 (sharded_model.h), so with one and
// two ranks the continued run must equal an uninterrupted one bit for bit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "engine_test_support.h"
#include "sharded_model.h"
#include "strata/nvme/fault_injection.h"
#include "strata/offload/local_communicator.h"
#include "support/scratch_dir.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
using strata::testing::ScratchDir;
using testing::Grad;
using testing::MakeDevice;
using testing::ShardedModel;
using testing::ShardedOptions;
using testing::Stage3Options;
using testing::TrainStep;
using testing::WorkingParameters;

using Parameters = std::vector<std::vector<float>>;
using RankBody = std::function<void(int rank, Engine& engine)>;

/// Runs `body` on `ranks` sharded engines of ShardedModel, each on a HostDevice and a thread of
/// its own, joined by local communicators.
void OnRanks(int ranks, const EngineOptions& options, const RankBody& body,
             const std::function<EngineEnvironment(int)>& environment = {}) {
  const ShardedModel model;
  auto comms = CreateLocalCommunicators({.size = ranks, .timeout_seconds = 30});
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      auto device = MakeDevice(64 << 20);
      EngineEnvironment env = environment ? environment(r) : EngineEnvironment{};
      env.communicator = std::move((*comms)[size_t(r)]);
      env.ranks_on_node = ranks;
      auto engine = Engine::Create(options, *device, model.specs, std::move(env));
      ASSERT_TRUE(engine.ok()) << "rank " << r << ": " << engine.status().ToString();
      body(r, **engine);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

/// Steps [first, first + steps) of rank `rank` of a sharded run.
Status TrainRank(Engine& engine, int rank, int first, int steps) {
  for (int step = first; step < first + steps; ++step) {
    STRATA_RETURN_IF_ERROR(TrainStep(engine, step, [&](int s, int m, size_t p, size_t i) {
                             return Grad(rank, s, m, p, i);
                           }).status());
  }
  return Status();
}

/// The same steps of one engine trained on the mean gradient of `ranks` ranks.
Status TrainMean(Engine& engine, int ranks, int first, int steps) {
  for (int step = first; step < first + steps; ++step) {
    STRATA_RETURN_IF_ERROR(TrainStep(engine, step, [&](int s, int m, size_t p, size_t i) {
                             float sum = 0.0f;
                             for (int r = 0; r < ranks; ++r) sum += Grad(r, s, m, p, i);
                             return sum / float(ranks);
                           }).status());
  }
  return Status();
}

/// One engine, not sharded, with `options`' placement.
struct SingleEngine {
  std::unique_ptr<Device> device = MakeDevice(64 << 20);
  std::unique_ptr<Engine> engine;

  explicit SingleEngine(EngineOptions options) {
    options.placement.zero_stage = 0;
    auto created = Engine::Create(options, *device, ShardedModel().specs);
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    if (created.ok()) engine = std::move(*created);
  }
};

struct CheckpointCase {
  const char* name;
  Tier states;
  int stage;
  Tier params = Tier::kHost;  // Stage 3: where each rank keeps its shard of the parameters.
};

EngineOptions OptionsFor(const CheckpointCase& sharded, const std::string& nvme_path) {
  if (sharded.stage != 3) return ShardedOptions(sharded.states, nvme_path);
  EngineOptions o = Stage3Options(sharded.states, nvme_path);
  o.placement.params = sharded.params;
  return o;
}

class ShardedCheckpointTest : public ::testing::TestWithParam<CheckpointCase> {};

// Two ranks save after two steps and train two more. The checkpoint, loaded by one engine, by
// two ranks and by three, gives back the saved parameters exactly; one engine and two ranks then
// continue exactly as the uninterrupted run, and three ranks (whose mean gradient is another)
// exactly as one engine that loaded it and trains on three ranks' mean.
TEST_P(ShardedCheckpointTest, SavedByTwoRanksLoadsIntoOneTwoOrThreeAndContinues) {
  ScratchDir dir;
  const EngineOptions options = OptionsFor(GetParam(), dir.path());
  const fs::path checkpoint = dir.path() / "checkpoint";
  std::vector<Parameters> saved(2), continued(2);
  OnRanks(2, options, [&](int rank, Engine& engine) {
    ASSERT_TRUE(TrainRank(engine, rank, 0, 2).ok());
    const Status status = engine.Save(checkpoint);
    ASSERT_TRUE(status.ok()) << "rank " << rank << ": " << status.ToString();
    saved[size_t(rank)] = WorkingParameters(engine);
    ASSERT_TRUE(TrainRank(engine, rank, 2, 2).ok());
    continued[size_t(rank)] = WorkingParameters(engine);
  });
  ASSERT_FALSE(saved[0].empty());
  EXPECT_TRUE(testing::BitEqual(saved[1], saved[0]));

  // What was written: rank 0's manifest naming both ranks' shard files, nothing left staged.
  nlohmann::json manifest = nlohmann::json::parse(std::ifstream(checkpoint / "manifest.json"));
  EXPECT_EQ(manifest["version"], 2);
  EXPECT_EQ(manifest["engine"]["world_size"], 2);
  EXPECT_EQ(manifest["chunks"][0]["shards"].size(), 2u);
  EXPECT_TRUE(fs::exists(checkpoint / "chunk-000000.rank-00001-of-00002.bin"));
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos) << entry.path();
  }

  // The uninterrupted run, as one engine: two ranks are it, bit for bit.
  SingleEngine reference(options);
  ASSERT_TRUE(TrainMean(*reference.engine, 2, 0, 4).ok());
  const Parameters uninterrupted = WorkingParameters(*reference.engine);
  EXPECT_TRUE(testing::BitEqual(continued[0], uninterrupted));

  // 2 -> 1.
  SingleEngine one(options);
  ASSERT_TRUE(one.engine->Load(checkpoint).ok());
  EXPECT_TRUE(testing::BitEqual(WorkingParameters(*one.engine), saved[0]));
  ASSERT_TRUE(TrainMean(*one.engine, 2, 2, 2).ok());
  EXPECT_TRUE(testing::BitEqual(WorkingParameters(*one.engine), uninterrupted))
      << "differs by " << testing::MaxAbsDiff(WorkingParameters(*one.engine), uninterrupted);

  // 2 -> 2.
  std::vector<Parameters> again(2);
  OnRanks(2, options, [&](int rank, Engine& engine) {
    const Status loaded = engine.Load(checkpoint);
    ASSERT_TRUE(loaded.ok()) << "rank " << rank << ": " << loaded.ToString();
    ASSERT_TRUE(TrainRank(engine, rank, 2, 2).ok());
    again[size_t(rank)] = WorkingParameters(engine);
  });
  EXPECT_TRUE(testing::BitEqual(again[0], uninterrupted));
  EXPECT_TRUE(testing::BitEqual(again[1], uninterrupted));

  // 2 -> 3, against one engine that loaded it and trains on three ranks' mean gradient.
  SingleEngine three_reference(options);
  ASSERT_TRUE(three_reference.engine->Load(checkpoint).ok());
  ASSERT_TRUE(TrainMean(*three_reference.engine, 3, 2, 2).ok());
  const Parameters three_expected = WorkingParameters(*three_reference.engine);
  std::vector<Parameters> loaded3(3), trained3(3);
  OnRanks(3, options, [&](int rank, Engine& engine) {
    const Status loaded = engine.Load(checkpoint);
    ASSERT_TRUE(loaded.ok()) << "rank " << rank << ": " << loaded.ToString();
    loaded3[size_t(rank)] = WorkingParameters(engine);
    ASSERT_TRUE(TrainRank(engine, rank, 2, 2).ok());
    trained3[size_t(rank)] = WorkingParameters(engine);
  });
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_TRUE(testing::BitEqual(loaded3[r], saved[0])) << "rank " << r;
    EXPECT_TRUE(testing::BitEqual(trained3[r], trained3[0])) << "rank " << r;
    // A third of a sum is not exact: the order of the reduction shows, to rounding.
    EXPECT_LT(testing::MaxAbsDiff(trained3[r], three_expected), 1e-6) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, ShardedCheckpointTest,
                         ::testing::Values(CheckpointCase{"states_host", Tier::kHost, 2},
                                           CheckpointCase{"states_nvme", Tier::kNvme, 2},
                                           CheckpointCase{"stage3_states_host", Tier::kHost, 3},
                                           CheckpointCase{"stage3_states_nvme", Tier::kNvme, 3},
                                           CheckpointCase{"stage3_params_nvme", Tier::kNvme, 3,
                                                          Tier::kNvme}),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

/// Every state of every parameter of ShardedModel (frozen ones: their values), read as one
/// batch: what a state_dict reads.
std::vector<std::vector<float>> ReadAllStates(Engine& engine, Status* status) {
  const ShardedModel model;
  std::vector<std::vector<float>> values;
  std::vector<ParameterStateRead> reads;
  for (size_t p = 0; p < model.specs.size(); ++p) {
    for (const ParameterState state :
         {ParameterState::kMaster, ParameterState::kExpAvg, ParameterState::kExpAvgSq}) {
      if (model.specs[p].frozen && state != ParameterState::kMaster) continue;
      values.emplace_back(model.values[p].size());
    }
  }
  size_t k = 0;
  for (size_t p = 0; p < model.specs.size(); ++p) {
    for (const ParameterState state :
         {ParameterState::kMaster, ParameterState::kExpAvg, ParameterState::kExpAvgSq}) {
      if (model.specs[p].frozen && state != ParameterState::kMaster) continue;
      reads.push_back({.parameter = p, .state = state, .out = values[k++]});
    }
  }
  *status = engine.ReadParameterStates(reads);
  return values;
}

/// New states for every parameter, derived from `states` (ReadAllStates' order): what a
/// load_state_dict from another optimizer writes. Frozen values change too.
Status WriteDerivedStates(Engine& engine, const std::vector<std::vector<float>>& states,
                          std::vector<std::vector<float>>* written) {
  const ShardedModel model;
  *written = states;
  std::vector<ParameterStateWrite> writes;
  size_t k = 0;
  for (size_t p = 0; p < model.specs.size(); ++p) {
    for (const ParameterState state :
         {ParameterState::kMaster, ParameterState::kExpAvg, ParameterState::kExpAvgSq}) {
      if (model.specs[p].frozen && state != ParameterState::kMaster) continue;
      std::vector<float>& values = (*written)[k++];
      for (size_t i = 0; i < values.size(); ++i) {
        values[i] = state == ParameterState::kExpAvgSq ? values[i] * 2.0f
                                                       : values[i] * 0.5f + float(i % 3) / 256.0f;
      }
      writes.push_back({.parameter = p, .state = state, .values = values});
    }
  }
  return engine.WriteParameterStates(writes);
}

// State access across ranks is a collective: every rank reads every parameter's whole states
// (gathered from the shards), writes them (each rank its part, the working parameters rebuilt
// from the gathered master) and sets the step count, and the ranks then train exactly as one
// engine that read, wrote and set the same: a state_dict and a load_state_dict of a sharded
// optimizer, as FSDP's full state dict.
TEST_P(ShardedCheckpointTest, StateAccessAcrossRanksIsOneEnginesBitForBit) {
  ScratchDir dir;
  const EngineOptions options = OptionsFor(GetParam(), dir.path());
  std::vector<std::vector<std::vector<float>>> read(2), reread(2);
  std::vector<Parameters> after_write(2), trained(2);
  OnRanks(2, options, [&](int rank, Engine& engine) {
    ASSERT_TRUE(TrainRank(engine, rank, 0, 2).ok());
    Status status;
    read[size_t(rank)] = ReadAllStates(engine, &status);
    ASSERT_TRUE(status.ok()) << "rank " << rank << ": " << status.ToString();
    std::vector<std::vector<float>> written;
    status = WriteDerivedStates(engine, read[size_t(rank)], &written);
    ASSERT_TRUE(status.ok()) << "rank " << rank << ": " << status.ToString();
    ASSERT_TRUE(engine.SetStepCount(7).ok());
    reread[size_t(rank)] = ReadAllStates(engine, &status);
    ASSERT_TRUE(status.ok()) << "rank " << rank << ": " << status.ToString();
    EXPECT_TRUE(testing::BitEqual(reread[size_t(rank)], written)) << "rank " << rank;
    after_write[size_t(rank)] = WorkingParameters(engine);  // Rounded from the new masters.
    ASSERT_TRUE(TrainRank(engine, rank, 2, 2).ok());
    trained[size_t(rank)] = WorkingParameters(engine);
  });
  ASSERT_FALSE(trained[0].empty());
  EXPECT_TRUE(testing::BitEqual(read[1], read[0]));

  SingleEngine one(options);
  ASSERT_TRUE(TrainMean(*one.engine, 2, 0, 2).ok());
  Status status;
  const auto expected = ReadAllStates(*one.engine, &status);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_TRUE(testing::BitEqual(read[0], expected))
      << "differs by " << testing::MaxAbsDiff(read[0], expected);
  std::vector<std::vector<float>> written;
  ASSERT_TRUE(WriteDerivedStates(*one.engine, expected, &written).ok());
  ASSERT_TRUE(one.engine->SetStepCount(7).ok());
  const Parameters written_params = WorkingParameters(*one.engine);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(testing::BitEqual(after_write[r], written_params))
        << "rank " << r << "'s working parameters differ by "
        << testing::MaxAbsDiff(after_write[r], written_params);
  }
  ASSERT_TRUE(TrainMean(*one.engine, 2, 2, 2).ok());
  const Parameters reference = WorkingParameters(*one.engine);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(testing::BitEqual(trained[r], reference))
        << "rank " << r << " differs by " << testing::MaxAbsDiff(trained[r], reference);
  }
}

// A rank asking for other states than the others (or another step count) would wait in a
// collective they never make: every rank gets InvalidArgument naming it, and nothing changes.
TEST(ShardedCheckpointTest, RanksAskingForDifferentStatesAreRefusedOnEveryRank) {
  ScratchDir dir;
  for (const int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const EngineOptions options = stage == 3 ? Stage3Options(Tier::kHost, dir.path())
                                             : ShardedOptions(Tier::kHost, dir.path());
    OnRanks(2, options, [&](int rank, Engine& engine) {
      ASSERT_TRUE(TrainRank(engine, rank, 0, 1).ok());
      const Parameters before = WorkingParameters(engine);
      std::vector<float> out(64);
      const Status read = engine.ReadParameterState(
          1, rank == 0 ? ParameterState::kExpAvg : ParameterState::kExpAvgSq, out);
      EXPECT_EQ(read.code(), StatusCode::kInvalidArgument) << "rank " << rank;
      EXPECT_NE(read.message().find("rank 1 of 2 asked for other parameters or states"),
                std::string::npos)
          << read.message();
      const Status set = engine.SetStepCount(rank == 0 ? 5 : 6);
      EXPECT_EQ(set.code(), StatusCode::kInvalidArgument) << "rank " << rank;
      // Stage 3: an Acquire leaves gathers of the chunks expected next in flight, which a write
      // throws away; a write that fails must leave them on every rank or on none (review
      // finding: the rank whose own checks passed threw them away, and the next Acquires
      // gathered out of step).
      ASSERT_TRUE(engine.Acquire(0).ok());
      engine.Release(0);
      // A write that one rank cannot take (a wrong size) fails on both, before anything changed.
      std::vector<float> values(rank == 0 ? 64 : 63, 1.0f);
      const Status write = engine.WriteParameterState(1, ParameterState::kMaster, values);
      EXPECT_FALSE(write.ok()) << "rank " << rank;
      // Stage 2: a rank that still holds a chunk fails its own checks; the other, whose checks
      // pass, fails too and keeps everything (gathers made ahead included).
      if (stage == 2) {
        std::vector<float> same(64, 1.0f);
        if (rank == 1) {
          ASSERT_TRUE(engine.Acquire(2).ok());
        }
        const Status held = engine.WriteParameterState(1, ParameterState::kMaster, same);
        EXPECT_FALSE(held.ok()) << "rank " << rank;
        if (rank == 1) engine.Release(2);
      }
      // Nor do ranks write different values (each would keep its own part: a silent mix).
      std::vector<float> own(64, rank == 0 ? 1.0f : 2.0f);
      const Status mixed = engine.WriteParameterState(1, ParameterState::kMaster, own);
      EXPECT_EQ(mixed.code(), StatusCode::kInvalidArgument) << "rank " << rank;
      EXPECT_TRUE(testing::BitEqual(WorkingParameters(engine), before)) << "rank " << rank;
      // The ranks still agree afterwards: training goes on.
      EXPECT_TRUE(TrainRank(engine, rank, 1, 1).ok()) << "rank " << rank;
    });
  }
}

// After a step that failed on one rank, the ranks whose own step succeeded committed it and the
// others did not: a read gathering their shards would return a mix, so every rank refuses it
// (review finding: it returned the mix).
TEST(ShardedCheckpointTest, StatesAreNotReadAcrossRanksAfterAFailedStep) {
  ScratchDir dir;
  auto plan = std::make_shared<nvme::FaultPlan>();
  std::vector<Status> stepped(2), read(2);
  OnRanks(
      2, ShardedOptions(Tier::kNvme, dir.path()),
      [&](int rank, Engine& engine) {
        ASSERT_TRUE(TrainRank(engine, rank, 0, 1).ok());
        if (rank == 1) {
          plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kRead, .times = -1});
        }
        stepped[size_t(rank)] = TrainRank(engine, rank, 1, 1);
        if (rank == 1) plan->Clear();
        ReadAllStates(engine, &read[size_t(rank)]);
      },
      testing::FaultyRankEnvironment(1, plan));
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_FALSE(stepped[r].ok()) << "rank " << r;
    EXPECT_EQ(read[r].code(), StatusCode::kFailedPrecondition)
        << "rank " << r << ": " << read[r].ToString();
    EXPECT_NE(read[r].message().find("after a failed step across ranks"), std::string::npos)
        << read[r].message();
  }
}

// A rank whose NVMe writes fail while it writes states leaves that chunk as it was on every
// rank (review finding: the other ranks had already rebuilt their working parameters from the
// gathered new master and switched to the new states, so the ranks ran on different weights).
TEST(ShardedCheckpointTest, AWriteThatFailsOnOneRanksNvmeLeavesEveryRankAsItWas) {
  ScratchDir dir;
  auto plan = std::make_shared<nvme::FaultPlan>();
  std::vector<std::vector<std::vector<float>>> before(2), after(2);
  std::vector<Parameters> params_before(2), params_after(2);
  std::vector<Status> wrote(2);
  OnRanks(
      2, ShardedOptions(Tier::kNvme, dir.path()),
      [&](int rank, Engine& engine) {
        ASSERT_TRUE(TrainRank(engine, rank, 0, 1).ok());
        Status status;
        before[size_t(rank)] = ReadAllStates(engine, &status);
        ASSERT_TRUE(status.ok()) << status.ToString();
        params_before[size_t(rank)] = WorkingParameters(engine);
        if (rank == 1) {
          plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kWrite, .times = -1});
        }
        std::vector<std::vector<float>> written;
        wrote[size_t(rank)] = WriteDerivedStates(engine, before[size_t(rank)], &written);
        if (rank == 1) plan->Clear();
        after[size_t(rank)] = ReadAllStates(engine, &status);
        ASSERT_TRUE(status.ok()) << status.ToString();
        params_after[size_t(rank)] = WorkingParameters(engine);
      },
      testing::FaultyRankEnvironment(1, plan));
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_FALSE(wrote[r].ok()) << "rank " << r;
    EXPECT_TRUE(testing::BitEqual(after[r], before[0]))
        << "rank " << r << "'s states differ by " << testing::MaxAbsDiff(after[r], before[0]);
    EXPECT_TRUE(testing::BitEqual(params_after[r], params_before[0]))
        << "rank " << r << "'s working parameters differ by "
        << testing::MaxAbsDiff(params_after[r], params_before[0]);
  }
}

// Each rank's progress callback counts the files that rank writes: its shards, and the frozen
// chunks whose turn is its (chunk i by rank i mod N), ending at (total, total).
TEST(ShardedCheckpointTest, EachRanksProgressCountsTheFilesItWrites) {
  ScratchDir dir;
  const EngineOptions options = ShardedOptions(Tier::kHost, dir.path());
  std::vector<std::vector<std::pair<size_t, size_t>>> progress(2);
  std::vector<size_t> frozen_turns(2, 0), chunks(2, 0);
  OnRanks(2, options, [&](int rank, Engine& engine) {
    ASSERT_TRUE(TrainRank(engine, rank, 0, 1).ok());
    const ChunkLayout& layout = engine.layout();
    chunks[size_t(rank)] = layout.chunk_count();
    for (size_t c = 0; c < layout.chunk_count(); ++c) {
      if (layout.chunk(c).frozen && c % 2 == size_t(rank)) ++frozen_turns[size_t(rank)];
    }
    SaveOptions save;
    save.on_chunk_saved = [&, rank](size_t done, size_t total) {
      progress[size_t(rank)].emplace_back(done, total);
    };
    ASSERT_TRUE(engine.Save(dir.path() / "checkpoint", save).ok());
  });
  for (size_t r = 0; r < 2; ++r) {
    const size_t trained = chunks[r] - (frozen_turns[0] + frozen_turns[1]);
    const size_t files = trained + frozen_turns[r];
    ASSERT_EQ(progress[r].size(), files) << "rank " << r;
    EXPECT_EQ(progress[r].back(), std::make_pair(files, files)) << "rank " << r;
  }
  EXPECT_EQ(frozen_turns[0] + frozen_turns[1], 1u);  // ShardedModel has one frozen chunk.
}

// One engine's checkpoint loads into two ranks (each takes its shard of every chunk's states),
// which continue exactly as the uninterrupted run.
TEST(ShardedCheckpointTest, SavedByOneLoadsIntoTwoRanksAndContinues) {
  ScratchDir dir;
  const EngineOptions options = ShardedOptions(Tier::kNvme, dir.path());
  const fs::path checkpoint = dir.path() / "checkpoint";
  SingleEngine reference(options);
  ASSERT_TRUE(TrainMean(*reference.engine, 2, 0, 2).ok());
  ASSERT_TRUE(reference.engine->Save(checkpoint).ok());
  ASSERT_TRUE(TrainMean(*reference.engine, 2, 2, 2).ok());
  const Parameters uninterrupted = WorkingParameters(*reference.engine);

  std::vector<Parameters> continued(2);
  OnRanks(2, options, [&](int rank, Engine& engine) {
    const Status loaded = engine.Load(checkpoint);
    ASSERT_TRUE(loaded.ok()) << "rank " << rank << ": " << loaded.ToString();
    ASSERT_TRUE(TrainRank(engine, rank, 2, 2).ok());
    continued[size_t(rank)] = WorkingParameters(engine);
  });
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(testing::BitEqual(continued[r], uninterrupted))
        << "rank " << r << " differs by " << testing::MaxAbsDiff(continued[r], uninterrupted);
  }
}

// A rank whose save fails (its NVMe reads fail) fails the save on every rank, naming it; the
// checkpoint saved before at the same path stays, whole, and nothing staged is left behind.
TEST(ShardedCheckpointTest, ARankWhoseSaveFailsFailsItEverywhereAndKeepsThePreviousOne) {
  ScratchDir dir;
  const EngineOptions options = ShardedOptions(Tier::kNvme, dir.path());
  const fs::path checkpoint = dir.path() / "checkpoint";
  auto plan = std::make_shared<nvme::FaultPlan>();
  std::vector<Status> second_save(2);
  std::vector<Parameters> first_saved(2);
  OnRanks(
      2, options,
      [&](int rank, Engine& engine) {
        ASSERT_TRUE(TrainRank(engine, rank, 0, 1).ok());
        ASSERT_TRUE(engine.Save(checkpoint).ok());
        first_saved[size_t(rank)] = WorkingParameters(engine);
        ASSERT_TRUE(TrainRank(engine, rank, 1, 1).ok());
        if (rank == 1) {
          plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kRead, .times = -1});
        }
        second_save[size_t(rank)] = engine.Save(checkpoint);
      },
      testing::FaultyRankEnvironment(1, plan));
  for (size_t r = 0; r < 2; ++r) EXPECT_FALSE(second_save[r].ok()) << "rank " << r;
  EXPECT_NE(second_save[0].message().find("failed on rank 1 of 2"), std::string::npos)
      << second_save[0].message();
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos) << entry.path();
  }
  SingleEngine one(options);
  const Status loaded = one.engine->Load(checkpoint);
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  EXPECT_TRUE(testing::BitEqual(WorkingParameters(*one.engine), first_saved[0]));
}

// Ranks that do not share the checkpoint's file system: rank 1 finds a directory of the staging
// directory's name where it looks (a leftover of an earlier run on its node, here a second path
// it was given), joins it and writes its shards there. The first rank must not commit a
// checkpoint without them, replacing a good one with one that cannot load: the save fails on
// both ranks, naming a missing file, and the previous checkpoint stays.
TEST(ShardedCheckpointTest, ShardsWrittenWhereTheFirstRankCannotSeeThemFailTheSave) {
  ScratchDir dir;
  const EngineOptions options = ShardedOptions(Tier::kHost, dir.path());
  const fs::path checkpoint = dir.path() / "checkpoint";
  const fs::path elsewhere = dir.path() / "node-1" / "checkpoint";
  // The staging directory's name there: "<dir>.tmp-<pid>" of the first rank's process, this one.
  fs::create_directories(fs::path(elsewhere.string() + ".tmp-" + std::to_string(::getpid())));
  std::vector<Status> second_save(2);
  std::vector<Parameters> first_saved(2);
  OnRanks(2, options, [&](int rank, Engine& engine) {
    ASSERT_TRUE(TrainRank(engine, rank, 0, 1).ok());
    ASSERT_TRUE(engine.Save(checkpoint).ok());
    first_saved[size_t(rank)] = WorkingParameters(engine);
    ASSERT_TRUE(TrainRank(engine, rank, 1, 1).ok());
    second_save[size_t(rank)] = engine.Save(rank == 0 ? checkpoint : elsewhere);
  });
  for (size_t r = 0; r < 2; ++r) EXPECT_FALSE(second_save[r].ok()) << "rank " << r;
  EXPECT_NE(second_save[0].message().find("chunk-000000.rank-00001-of-00002.bin"),
            std::string::npos)
      << second_save[0].message();
  SingleEngine one(options);
  const Status loaded = one.engine->Load(checkpoint);
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  EXPECT_TRUE(testing::BitEqual(WorkingParameters(*one.engine), first_saved[0]));
}

// A rank whose NVMe writes fail while it stages a checkpoint's states fails Load on every rank
// before any of them changes its memory: the others must not go on with the loaded state while
// it keeps the old one (review finding: they did, and only reported the other rank's failure).
TEST(ShardedCheckpointTest, ARankThatCannotStageTheStatesLeavesEveryRankAsItWas) {
  ScratchDir dir;
  const EngineOptions options = ShardedOptions(Tier::kNvme, dir.path());
  const fs::path checkpoint = dir.path() / "checkpoint";
  auto plan = std::make_shared<nvme::FaultPlan>();
  std::vector<Status> loads(2);
  std::vector<Parameters> before(2), after(2);
  OnRanks(
      2, options,
      [&](int rank, Engine& engine) {
        ASSERT_TRUE(TrainRank(engine, rank, 0, 1).ok());
        ASSERT_TRUE(engine.Save(checkpoint).ok());
        ASSERT_TRUE(TrainRank(engine, rank, 1, 1).ok());
        before[size_t(rank)] = WorkingParameters(engine);
        if (rank == 1) {
          plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kWrite, .times = -1});
        }
        loads[size_t(rank)] = engine.Load(checkpoint);
        after[size_t(rank)] = WorkingParameters(engine);
      },
      testing::FaultyRankEnvironment(1, plan));
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_FALSE(loads[r].ok()) << "rank " << r;
    EXPECT_TRUE(testing::BitEqual(after[r], before[r])) << "rank " << r << " changed";
  }
  EXPECT_NE(loads[0].message().find("failed on rank 1 of 2"), std::string::npos)
      << loads[0].message();
}

// A shard file that is corrupted fails Load on every rank before any of them changes anything.
TEST(ShardedCheckpointTest, ACorruptedShardChangesNothingOnAnyRank) {
  ScratchDir dir;
  const EngineOptions options = ShardedOptions(Tier::kHost, dir.path());
  const fs::path checkpoint = dir.path() / "checkpoint";
  OnRanks(2, options, [&](int rank, Engine& engine) {
    ASSERT_TRUE(TrainRank(engine, rank, 0, 1).ok());
    ASSERT_TRUE(engine.Save(checkpoint).ok());
  });
  {
    std::fstream file(checkpoint / "chunk-000001.rank-00001-of-00002.bin",
                      std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(100);
    file.put('\x7f');
  }
  std::vector<Status> loads(2);
  std::vector<Parameters> before(2), after(2);
  OnRanks(2, options, [&](int rank, Engine& engine) {
    before[size_t(rank)] = WorkingParameters(engine);
    loads[size_t(rank)] = engine.Load(checkpoint);
    after[size_t(rank)] = WorkingParameters(engine);
  });
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(loads[r].code(), StatusCode::kDataLoss)
        << "rank " << r << ": " << loads[r].ToString();
    EXPECT_TRUE(testing::BitEqual(after[r], before[r])) << "rank " << r;
  }
}

}  // namespace
}  // namespace strata::offload
