// Sharded engines (ZeRO stages 1, 2 and 3): several ranks, each an engine on its own HostDevice and
// thread, joined by local communicators, against one engine trained on the ranks' mean
// gradients. The gradients are small multiples of 2^-8, so every sum of them is exact in fp32
// in any order: with two ranks the sharded trajectory must equal the reference bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine_test_support.h"
#include "sharded_model.h"
#include "strata/core/aligned_buffer.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "strata/nvme/fault_injection.h"
#include "strata/offload/local_communicator.h"
#include "support/scratch_dir.h"
#include "wrapped_device.h"

namespace strata::offload {
namespace {

using strata::testing::ScratchDir;
using testing::Grad;
using testing::MakeDevice;
using testing::ShardedModel;
using testing::ShardedOptions;
using testing::Stage3Options;
using testing::TrainStep;
using testing::WorkingParameters;

/// What every rank of a sharded run ends with.
struct RankResult {
  Status status;
  std::vector<StepReport> reports;
  std::vector<std::vector<float>> initial_params;  // Before the first step.
  std::vector<std::vector<float>> params;
  size_t chunks = 0;
  size_t trained_numel = 0;  // Elements of the trained chunks (padded to a multiple of ranks).
  std::vector<size_t> trained_chunk_numels;
  bool padded_to_shards = true;
  EngineCounters counters;
  uint64_t host_bytes = 0;
  // Time the trainer waited for collectives (stage 3's gathers, stage 2's landing buffers).
  double collective_stall_seconds = 0.0;
};

/// Trains `ranks` sharded engines for `steps` steps, each on a thread of its own; rank r writes
/// Grad(r, ...) scaled by `scale`, or `grad(r, ...)` when given. Rank `reordering_rank`
/// declares gradients in `reordered`.
std::vector<RankResult> TrainSharded(
    int ranks, const EngineOptions& options, int steps, float scale = 1.0f,
    std::function<EngineEnvironment(int)> environment = {}, int reordering_rank = -1,
    std::function<void(int, testing::WrappedDevice&)> on_device = {},
    uint64_t device_bytes = 64 << 20,
    testing::DeclareOrder reordered = testing::DeclareOrder::kLastTwoSwapped,
    std::function<float(int rank, int step, int micro, size_t p, size_t i)> grad = {}) {
  const ShardedModel model;
  auto comms = CreateLocalCommunicators({.size = ranks, .timeout_seconds = 30});
  EXPECT_TRUE(comms.ok());
  std::vector<RankResult> results(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      RankResult& result = results[size_t(r)];
      auto inner = MakeDevice(device_bytes);
      testing::WrappedDevice device(*inner);
      EngineEnvironment env = environment ? environment(r) : EngineEnvironment{};
      env.communicator = std::move((*comms)[size_t(r)]);
      env.ranks_on_node = ranks;
      auto engine = Engine::Create(options, device, model.specs, std::move(env));
      if (!engine.ok()) {
        result.status = engine.status();
        return;
      }
      const ChunkLayout& layout = (*engine)->layout();
      result.chunks = layout.chunk_count();
      if (on_device) on_device(r, device);
      result.initial_params = WorkingParameters(**engine);
      const EngineCounters before = (*engine)->counters();
      for (size_t c = 0; c < layout.chunk_count(); ++c) {
        if (!layout.chunk(c).frozen) {
          result.trained_numel += layout.chunk(c).numel;
          result.trained_chunk_numels.push_back(layout.chunk(c).numel);
        }
        result.padded_to_shards &=
            layout.chunk(c).numel % size_t(ranks) == 0 &&
            layout.shard(c, r).numel() * size_t(ranks) == layout.chunk(c).numel;
      }
      for (int step = 0; step < steps && result.status.ok(); ++step) {
        auto report = TrainStep(
            **engine, step,
            [&](int s, int m, size_t p, size_t i) {
              return grad ? grad(r, s, m, p, i) : Grad(r, s, m, p, i, scale);
            },
            r == reordering_rank ? reordered : testing::DeclareOrder::kBackward,
            options.optimizer.gradient_accumulation_steps);
        result.status = report.status();
        if (report.ok()) result.reports.push_back(*report);
      }
      // The steps' alone: reading the parameters gathers them with stage 3.
      result.counters = (*engine)->counters() - before;
      result.host_bytes = (*engine)->tier_usage(Tier::kHost).used_bytes;
      result.collective_stall_seconds =
          (*engine)
              ->metrics()
              .GetCounter("strata_trainer_stall_seconds_total", "", {{"resource", "collective"}})
              .Value();
      if (result.status.ok()) result.params = WorkingParameters(**engine);
    });
  }
  for (std::thread& thread : threads) thread.join();
  return results;
}

/// One engine trained on the ranks' mean gradient (exact: a sum of small multiples of 2^-8,
/// halved).
std::vector<std::vector<float>> TrainReference(int ranks, const EngineOptions& options, int steps,
                                               std::vector<StepReport>* reports,
                                               float scale = 1.0f) {
  const ShardedModel model;
  auto device = MakeDevice(64 << 20);
  EngineOptions one = options;
  one.placement.zero_stage = 0;
  one.placement.quantized_weights = one.placement.quantized_gradients = false;
  auto engine = Engine::Create(one, *device, model.specs);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  for (int step = 0; step < steps; ++step) {
    auto report = TrainStep(
        **engine, step,
        [&](int s, int m, size_t p, size_t i) {
          float sum = 0.0f;
          for (int r = 0; r < ranks; ++r) sum += Grad(r, s, m, p, i, scale);
          return sum / float(ranks);
        },
        testing::DeclareOrder::kBackward, options.optimizer.gradient_accumulation_steps);
    EXPECT_TRUE(report.ok()) << report.status().ToString();
    if (!report.ok()) return {};
    reports->push_back(*report);
  }
  return WorkingParameters(**engine);
}

/// Every rank of `ranks` trained without error and ends with the parameters of one engine
/// trained on their mean gradient for `steps` steps, bit for bit.
void ExpectEveryRankEndsAsTheReference(const std::vector<RankResult>& ranks,
                                       const EngineOptions& options, int steps) {
  std::vector<StepReport> reference_reports;
  const auto reference = TrainReference(int(ranks.size()), options, steps, &reference_reports);
  ASSERT_FALSE(reference.empty());
  for (size_t r = 0; r < ranks.size(); ++r) {
    ASSERT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status.ToString();
    EXPECT_TRUE(testing::BitEqual(ranks[r].params, reference))
        << "rank " << r << " differs by " << testing::MaxAbsDiff(ranks[r].params, reference);
  }
}

struct ShardedCase {
  const char* name;
  Tier states;
  int stage;
  // 1: each chunk is reduced from the ReduceRing's few buffers, not a gradient sum of its own.
  int micro_steps = 2;
  // Stage 3: where each rank keeps its shard of the parameters (ZeRO-Infinity: nvme).
  Tier params = Tier::kHost;
};

EngineOptions OptionsFor(const ShardedCase& sharded, const std::string& nvme_path) {
  EngineOptions o = sharded.stage == 3 ? Stage3Options(sharded.states, nvme_path)
                                       : ShardedOptions(sharded.states, nvme_path);
  if (sharded.stage == 3) o.placement.params = sharded.params;
  o.placement.zero_stage = sharded.stage;
  o.optimizer.gradient_accumulation_steps = sharded.micro_steps;
  return o;
}

class ShardingTest : public ::testing::TestWithParam<ShardedCase> {};

// Two ranks, each keeping half of every chunk's optimizer states (host or NVMe), reduce-scatter
// their gradients, update their halves and all-gather the parameters (stage 2: after the
// update; stage 3: on every Acquire, from each rank's half): every rank ends with the
// parameters of one engine trained on the mean gradient, bit for bit, and reports its norm.
TEST_P(ShardingTest, TwoRanksTrainExactlyAsOneOnTheMeanGradient) {
  ScratchDir dir;
  const EngineOptions options = OptionsFor(GetParam(), dir.path());
  constexpr int kSteps = 3;
  std::vector<RankResult> ranks = TrainSharded(2, options, kSteps);
  std::vector<StepReport> reference_reports;
  const auto reference = TrainReference(2, options, kSteps, &reference_reports);
  ASSERT_FALSE(reference.empty());
  const ShardedModel model;
  for (size_t r = 0; r < ranks.size(); ++r) {
    ASSERT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status.ToString();
    EXPECT_TRUE(testing::BitEqual(ranks[r].initial_params, model.values)) << "rank " << r;
    EXPECT_TRUE(testing::BitEqual(ranks[r].params, reference))
        << "rank " << r << " differs by " << testing::MaxAbsDiff(ranks[r].params, reference);
    ASSERT_EQ(ranks[r].reports.size(), size_t(kSteps));
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(ranks[r].reports[s].step, s + 1);
      // The norm is summed in another order (shards, then ranks): equal up to rounding.
      EXPECT_NEAR(ranks[r].reports[s].grad_norm, reference_reports[s].grad_norm,
                  1e-9 * reference_reports[s].grad_norm)
          << "rank " << r << " step " << s;
      EXPECT_EQ(ranks[r].reports[s].grad_norm, ranks[0].reports[s].grad_norm);
    }
  }
  EXPECT_GT(ranks[0].chunks, 2u);
}

INSTANTIATE_TEST_SUITE_P(
    Placements, ShardingTest,
    ::testing::Values(ShardedCase{"stage1_states_host", Tier::kHost, 1},
                      ShardedCase{"stage1_states_nvme", Tier::kNvme, 1},
                      ShardedCase{"states_host", Tier::kHost, 2},
                      ShardedCase{"states_nvme", Tier::kNvme, 2},
                      ShardedCase{"stage3_states_host", Tier::kHost, 3},
                      ShardedCase{"stage3_states_nvme", Tier::kNvme, 3},
                      ShardedCase{"one_micro_step", Tier::kHost, 2, 1},
                      ShardedCase{"one_micro_step_nvme", Tier::kNvme, 2, 1},
                      ShardedCase{"stage3_one_micro_step", Tier::kHost, 3, 1},
                      ShardedCase{"three_micro_steps", Tier::kHost, 2, 3},
                      ShardedCase{"stage3_three_micro_steps_nvme", Tier::kNvme, 3, 3},
                      ShardedCase{"stage3_params_nvme", Tier::kHost, 3, 2, Tier::kNvme},
                      ShardedCase{"stage3_params_and_states_nvme_one_micro_step", Tier::kNvme, 3, 1,
                                  Tier::kNvme}),
    [](const auto& param_info) { return std::string(param_info.param.name); });

// ZeRO-Infinity across ranks (stage 3 with offload_param nvme): each rank keeps its shard of the
// parameters on NVMe and reads it for each gather; the update writes the shard back. So the
// NVMe traffic per rank is 1/N of the parameters it gathers and updates.
TEST(ShardingTest, StageThreeKeepsEachRanksParameterShardOnNvme) {
  ScratchDir dir;
  // States in host memory: the parameter shards are all that NVMe holds.
  const EngineOptions options = OptionsFor({"", Tier::kHost, 3, 2, Tier::kNvme}, dir.path());
  constexpr int kSteps = 2;
  const std::vector<RankResult> ranks = TrainSharded(2, options, kSteps);
  ExpectEveryRankEndsAsTheReference(ranks, options, kSteps);
  for (size_t r = 0; r < ranks.size(); ++r) {
    const EngineCounters& moved = ranks[r].counters;
    const uint64_t shards_bytes = ranks[r].trained_numel / ranks.size() * sizeof(float);
    EXPECT_GT(moved.all_gather_bytes, 0u);
    // Each gather reads this rank's shard of the chunk; each step writes every shard once.
    EXPECT_EQ(moved.nvme_read_bytes, moved.all_gather_bytes / ranks.size()) << "rank " << r;
    EXPECT_EQ(moved.nvme_write_bytes, kSteps * shards_bytes) << "rank " << r;
  }
}

// The ranks' collectives go in one fixed chunk order, whatever order each rank's backward
// declares gradients in: a rank whose last two chunks come the other way round (chunks of the
// same size, so nothing but the order tells them apart) still reduces each chunk with its peers'
// same chunk.
// With one micro-step, a chunk declared early also waits for its reduce-scatter to be queued
// before it takes a ReduceRing slot; declared in forward order, every reduce-scatter is queued
// at the last declaration, and all but two wait for a slot's turn.
TEST(ShardingTest, RanksThatDeclareGradientsInAnotherOrderStillReduceTheSameChunks) {
  ScratchDir dir;
  for (const auto& [micro_steps, order] : {std::pair{2, testing::DeclareOrder::kLastTwoSwapped},
                                           std::pair{1, testing::DeclareOrder::kLastTwoSwapped},
                                           std::pair{1, testing::DeclareOrder::kForward}}) {
    SCOPED_TRACE(std::to_string(micro_steps) + " micro-steps, order " + std::to_string(int(order)));
    const EngineOptions options = OptionsFor({"", Tier::kHost, 2, micro_steps}, dir.path());
    constexpr int kSteps = 2;
    std::vector<RankResult> ranks = TrainSharded(2, options, kSteps, 1.0f, {},
                                                 /*reordering_rank=*/1, {}, 64 << 20, order);
    ExpectEveryRankEndsAsTheReference(ranks, options, kSteps);
  }
}

// ZeRO stage 2's memory: a rank keeps, of the fp32 gradients, only its shard and the
// ReduceRing's two buffers as large as the largest chunk, not a sum of every chunk. Accumulating
// micro-steps, stage 2 reduces each one into the shard (the ring's buffers then also hold a
// reduced shard each), while stage 1 keeps every chunk's fp32 sum all step and reduces it once.
TEST(ShardingTest, StageTwoKeepsOnlyItsShardOfTheFp32GradientsEvenWhenAccumulating) {
  ScratchDir dir;
  auto run = [&](int stage, int micro_steps) {
    const EngineOptions options = OptionsFor({"", Tier::kHost, stage, micro_steps}, dir.path());
    // Three ranks: a reduced shard is a third of a chunk, so what each way keeps differs.
    std::vector<RankResult> ranks = TrainSharded(3, options, 1);
    EXPECT_TRUE(ranks[0].status.ok()) << ranks[0].status.ToString();
    return ranks[0];
  };
  const RankResult one = run(2, 1);
  const RankResult accumulating = run(2, 2);
  const RankResult stage1_accumulating = run(1, 2);
  ASSERT_GT(one.chunks, 3u) << "more chunks than the ring has buffers";
  uint64_t sums = 0;
  size_t largest = 0;
  for (size_t numel : one.trained_chunk_numels) {
    sums += AlignUp(numel * sizeof(float), strata::kHostAlignment);
    largest = std::max(largest, numel);
  }
  const uint64_t ring = 2 * AlignUp(largest * sizeof(float), strata::kHostAlignment);
  const uint64_t reduced_shards = 2 * AlignUp(largest / 3 * sizeof(float), strata::kHostAlignment);
  ASSERT_NE(sums - ring, reduced_shards) << "a model where the two ways keep the same bytes";
  EXPECT_EQ(accumulating.host_bytes - one.host_bytes, reduced_shards);
  EXPECT_EQ(stage1_accumulating.host_bytes - one.host_bytes, sums - ring);
}

// Three ranks: each pads every chunk to three equal shards and updates only its own (a third
// of the CPU optimizer's work). The mean is not exact any more (a third), but the trajectory is
// the reference's to rounding, and every rank holds the same parameters bit for bit.
void ExpectThreeRanksFollowTheMeanGradient(const EngineOptions& options);

TEST(ShardingTest, ThreeRanksAgreeBitForBitAndFollowTheMeanGradient) {
  ScratchDir dir;
  for (const int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const EngineOptions options = OptionsFor({"", Tier::kHost, stage}, dir.path());
    ExpectThreeRanksFollowTheMeanGradient(options);
  }
}

void ExpectThreeRanksFollowTheMeanGradient(const EngineOptions& options) {
  constexpr int kSteps = 2;
  std::vector<RankResult> ranks = TrainSharded(3, options, kSteps);
  std::vector<StepReport> reference_reports;
  const auto reference = TrainReference(3, options, kSteps, &reference_reports);
  ASSERT_FALSE(reference.empty());
  for (size_t r = 0; r < ranks.size(); ++r) {
    ASSERT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status.ToString();
    EXPECT_TRUE(testing::BitEqual(ranks[r].params, ranks[0].params)) << "rank " << r;
    EXPECT_LT(testing::MaxAbsDiff(ranks[r].params, reference), 1e-6) << "rank " << r;
    EXPECT_TRUE(ranks[r].padded_to_shards) << "rank " << r;
    EXPECT_EQ(ranks[r].counters.optimizer_params, kSteps * ranks[r].trained_numel / 3)
        << "rank " << r;
  }
}

// What each stage moves between ranks per step, as the ZeRO paper counts it (Ψ: the trained
// chunks' bytes): stage 1 reduce-scatters the gradients summed over the micro-steps and
// all-gathers the updated parameters once (2Ψ); stage 2 reduce-scatters every micro-step's
// gradients (two here), as DeepSpeed's stage 2 does, so that no rank keeps a whole chunk's sum
// (the paper's 2Ψ is a step of one micro-step); stage 3 also gathers the parameters on every
// Acquire — forward's and backward's of each micro-step — and never after the update.
TEST(ShardingTest, EachStageMovesTheBytesZeroPredicts) {
  ScratchDir dir;
  constexpr int kSteps = 2;
  constexpr int kMicroSteps = 2;
  for (const int stage : {1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const EngineOptions options = OptionsFor({"", Tier::kHost, stage, kMicroSteps}, dir.path());
    std::vector<RankResult> ranks = TrainSharded(2, options, kSteps);
    for (size_t r = 0; r < ranks.size(); ++r) {
      ASSERT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status.ToString();
      const uint64_t psi = ranks[r].trained_numel * sizeof(float);  // fp32 working parameters
      const uint64_t reductions = stage == 1 ? 1 : kMicroSteps;
      EXPECT_EQ(ranks[r].counters.reduce_scatter_bytes, kSteps * reductions * psi) << "rank " << r;
      const uint64_t gathers = stage == 3 ? 2 * kMicroSteps : 1;
      EXPECT_EQ(ranks[r].counters.all_gather_bytes, kSteps * gathers * psi) << "rank " << r;
    }
  }
}

// Reducing every micro-step, a chunk's next micro-step lands where the last one waits for its
// reduce-scatter's buffer: with a peer late to start, the first rank's trainer waits in
// GradsReady (counted as a collective stall) rather than overwriting gradients not yet taken,
// and both ranks still end where one engine on the mean gradient does.
TEST(ShardingTest, StageTwoWaitsForTheLastMicroStepsBufferWhenAPeerIsLate) {
  ScratchDir dir;
  const EngineOptions options = OptionsFor({"", Tier::kHost, 2, 2}, dir.path());
  constexpr int kSteps = 2;
  std::vector<RankResult> ranks =
      TrainSharded(2, options, kSteps, 1.0f, {}, -1, [](int rank, testing::WrappedDevice&) {
        if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      });
  ExpectEveryRankEndsAsTheReference(ranks, options, kSteps);
  // Rank 0's first micro-step fills both ring slots; its third reduce-scatter, and so chunk 0's
  // second micro-step, waits for rank 1.
  EXPECT_GT(ranks[0].collective_stall_seconds, 0.1);
}

// ZeRO++'s quantized weights: stage 3 gathers each shard as blockwise int8. The trainer's
// gradients here do not depend on the parameters, so the master weights follow the unquantized
// run exactly; what the trainer reads (gathered) is their dequantized form — the same on every
// rank, within half a quantization step of the exact values — and the gathers move about a
// quarter of fp32's bytes.
TEST(ShardingTest, StageThreeQuantizedWeightsGatherInt8AndEveryRankSeesTheSame) {
  ScratchDir dir;
  constexpr int kSteps = 2;
  const EngineOptions exact_options = Stage3Options(Tier::kHost, dir.path());
  EngineOptions options = exact_options;
  options.placement.quantized_weights = true;
  std::vector<RankResult> exact = TrainSharded(2, exact_options, kSteps);
  std::vector<RankResult> ranks = TrainSharded(2, options, kSteps);
  ASSERT_TRUE(exact[0].status.ok()) << exact[0].status.ToString();
  const ShardedModel model;
  float largest = 0.0f;
  for (const auto& values : exact[0].params) {
    for (float v : values) largest = std::max(largest, std::fabs(v));
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    ASSERT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status.ToString();
    EXPECT_TRUE(testing::BitEqual(ranks[r].params, ranks[0].params)) << "rank " << r;
    const double diff = testing::MaxAbsDiff(ranks[r].params, exact[0].params);
    EXPECT_GT(diff, 0.0) << "nothing was quantized";
    EXPECT_LE(diff, largest / 254.0 * 1.0001) << "rank " << r;
    // The frozen parameter (p5) stays whole on every rank: never gathered, never quantized.
    EXPECT_EQ(ranks[r].params.back(), model.values.back());
    // Each gather of a chunk moves every rank's quantized shard instead of its fp32 values.
    uint64_t exact_bytes = 0, quantized_bytes = 0;
    for (size_t numel : ranks[r].trained_chunk_numels) {
      exact_bytes += numel * sizeof(float);
      quantized_bytes += 2 * cpu_adam::QuantizedBytes(numel / 2, 8);
    }
    ASSERT_GT(exact[r].counters.all_gather_bytes, 0u);
    EXPECT_EQ(ranks[r].counters.all_gather_bytes * exact_bytes,
              exact[r].counters.all_gather_bytes * quantized_bytes)
        << "rank " << r;
    EXPECT_LT(double(ranks[r].counters.all_gather_bytes),
              0.27 * double(exact[r].counters.all_gather_bytes));
  }
  // Shards kept on NVMe are read, then quantized: the same bytes as from host memory.
  options.placement.params = Tier::kNvme;
  const std::vector<RankResult> from_nvme = TrainSharded(2, options, kSteps);
  for (size_t r = 0; r < from_nvme.size(); ++r) {
    ASSERT_TRUE(from_nvme[r].status.ok()) << "rank " << r << ": " << from_nvme[r].status.ToString();
    EXPECT_GT(from_nvme[r].counters.nvme_read_bytes, 0u);
    EXPECT_TRUE(testing::BitEqual(from_nvme[r].params, ranks[r].params)) << "rank " << r;
  }
}

// ZeRO++'s quantized gradients: each rank sends every other its partition of the gradients as
// blockwise int8 or int4 (an all-to-all) and sums what it receives in fp32. With and without
// accumulation (the ReduceRing then quantizes each chunk's fp32 sum, or its widened
// gradients): the ranks agree bit for bit, follow the mean gradient to within what the
// quantization changes, and move a quarter (int8) or an eighth (int4) of an fp32
// reduce-scatter's bytes, plus the scales.
TEST(ShardingTest, StageThreeQuantizedGradientsReduceInt8OrInt4AndFollowTheMeanGradient) {
  ScratchDir dir;
  constexpr int kSteps = 3;
  for (const int micro_steps : {2, 1}) {
    EngineOptions options = OptionsFor({"", Tier::kHost, 3, micro_steps}, dir.path());
    const std::vector<RankResult> exact = TrainSharded(2, options, kSteps);
    ASSERT_TRUE(exact[0].status.ok()) << exact[0].status.ToString();
    std::vector<StepReport> reference_reports;
    const auto reference = TrainReference(2, options, kSteps, &reference_reports);
    ASSERT_FALSE(reference.empty());
    for (const int bits : {8, 4}) {
      SCOPED_TRACE(std::to_string(micro_steps) + " micro-steps, " + std::to_string(bits) + " bits");
      options.placement.quantized_gradients = true;
      options.placement.quantized_gradient_bits = bits;
      const std::vector<RankResult> ranks = TrainSharded(2, options, kSteps);
      // Half a step of the block's largest gradient: 1/254 or 1/14 of it.
      const double tolerance = bits == 8 ? 2e-3 : 2e-2;
      double diffs[2] = {};
      for (size_t r = 0; r < ranks.size(); ++r) {
        ASSERT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status.ToString();
        EXPECT_TRUE(testing::BitEqual(ranks[r].params, ranks[0].params)) << "rank " << r;
        diffs[r] = testing::MaxAbsDiff(ranks[r].params, reference);
        EXPECT_GT(diffs[r], 0.0) << "nothing was quantized";
        EXPECT_LT(diffs[r], tolerance) << "rank " << r;
        for (int s = 0; s < kSteps; ++s) {
          EXPECT_NEAR(ranks[r].reports[s].grad_norm, reference_reports[s].grad_norm,
                      tolerance * 5 * reference_reports[s].grad_norm);
        }
        uint64_t exact_bytes = 0, quantized_bytes = 0;
        for (size_t numel : ranks[r].trained_chunk_numels) {
          exact_bytes += numel * sizeof(float);
          quantized_bytes += 2 * cpu_adam::QuantizedBytes(numel / 2, bits);
        }
        EXPECT_EQ(ranks[r].counters.reduce_scatter_bytes * exact_bytes,
                  exact[r].counters.reduce_scatter_bytes * quantized_bytes);
        EXPECT_LT(double(ranks[r].counters.reduce_scatter_bytes),
                  (bits == 8 ? 0.27 : 0.14) * double(exact[r].counters.reduce_scatter_bytes));
      }
      std::printf("[ qgZ ] %d micro-steps, int%d: max |param - mean-gradient engine's| %.3g\n",
                  micro_steps, bits, diffs[0]);
    }
  }
}

// Quantizing must not hide a non-finite gradient: one NaN among finite gradients reaches the
// shard with the quantized reduction as with the exact one (so fp16's overflow check sees it),
// rather than coming back as finite garbage: the parameter it steps becomes NaN on both paths.
TEST(ShardingTest, QuantizedGradientsKeepANonFiniteGradientVisible) {
  ScratchDir dir;
  auto grad = [](int r, int s, int m, size_t p, size_t i) {
    return r == 0 && p == 0 && i == 3 ? std::numeric_limits<float>::quiet_NaN()
                                      : Grad(r, s, m, p, i);
  };
  for (const int bits : {0, 8, 4}) {  // 0: exact.
    SCOPED_TRACE(bits == 0 ? "exact" : "int" + std::to_string(bits));
    EngineOptions options = OptionsFor({"", Tier::kHost, 3, 1}, dir.path());
    options.placement.quantized_gradients = bits != 0;
    if (bits != 0) options.placement.quantized_gradient_bits = bits;
    const std::vector<RankResult> ranks = TrainSharded(2, options, 1, 1.0f, {}, -1, {}, 64 << 20,
                                                       testing::DeclareOrder::kBackward, grad);
    for (size_t r = 0; r < ranks.size(); ++r) {
      ASSERT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status.ToString();
      EXPECT_TRUE(std::isnan(ranks[r].params[0][3]))
          << "rank " << r << ": parameter 0 element 3 is " << ranks[r].params[0][3];
      EXPECT_TRUE(std::isfinite(ranks[r].params[2][0])) << "rank " << r;  // Another chunk.
    }
  }
}

// Stage 3 needs the device to hold only the chunks in use: with room for two of the three
// trained chunks, chunks are evicted and gathered again on their next Acquire, and the ranks
// still train exactly as one engine on the mean gradient.
TEST(ShardingTest, StageThreeTrainsWithADeviceThatCannotHoldTheModel) {
  ScratchDir dir;
  const EngineOptions options = Stage3Options(Tier::kHost, dir.path());
  constexpr int kSteps = 3;
  constexpr uint64_t kTwoChunks = 2 * 2 * testing::kShardedChunkBytes + 16 * 1024;
  std::vector<RankResult> ranks =
      TrainSharded(2, options, kSteps, 1.0f, {}, -1, {}, /*device_bytes=*/kTwoChunks);
  std::vector<StepReport> reference_reports;
  const auto reference = TrainReference(2, options, kSteps, &reference_reports);
  ASSERT_FALSE(reference.empty());
  for (size_t r = 0; r < ranks.size(); ++r) {
    ASSERT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status.ToString();
    EXPECT_GT(ranks[r].counters.evictions, 0u) << "rank " << r;
    EXPECT_TRUE(testing::BitEqual(ranks[r].params, reference))
        << "rank " << r << " differs by " << testing::MaxAbsDiff(ranks[r].params, reference);
  }
}

/// Runs `body` on two stage-3 ranks of ShardedModel (states on `states`; rank r's engine with
/// `environment(r)`, if given), each an engine on a wrapped HostDevice and a thread of its own,
/// whose collectives time out after `timeout` seconds.
void OnStageThreeRanks(const std::string& nvme_path, double timeout,
                       const std::function<void(int, Engine&, testing::WrappedDevice&)>& body,
                       Tier states = Tier::kHost,
                       const std::function<EngineEnvironment(int)>& environment = {},
                       Tier params = Tier::kHost) {
  const ShardedModel model;
  EngineOptions options = Stage3Options(states, nvme_path);
  options.placement.params = params;
  auto comms = CreateLocalCommunicators({.size = 2, .timeout_seconds = timeout});
  ASSERT_TRUE(comms.ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto inner = MakeDevice(64 << 20);
      testing::WrappedDevice device(*inner);
      EngineEnvironment env = environment ? environment(r) : EngineEnvironment{};
      env.communicator = std::move((*comms)[size_t(r)]);
      auto engine = Engine::Create(options, device, model.specs, std::move(env));
      ASSERT_TRUE(engine.ok()) << engine.status().ToString();
      body(r, **engine, device);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// With stage 3 an Acquire is a collective, so it must not depend on how far this rank's step
// has got: right after Step(), before its future is ready (rank 1 is late to the step, so rank
// 0's cannot have finished), Acquire waits for the step and gathers its new parameters.
TEST(ShardingTest, StageThreeAcquireRightAfterStepWaitsForTheStep) {
  ScratchDir dir;
  std::vector<std::vector<std::vector<float>>> after(2);
  OnStageThreeRanks(dir.path(), 30, [&](int r, Engine& engine, testing::WrappedDevice&) {
    auto grad = [&](int s, int m, size_t p, size_t i) { return Grad(r, s, m, p, i); };
    ASSERT_TRUE(testing::ForwardBackward(engine, 0, grad).ok());
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::future<Result<StepReport>> step = engine.Step();
    Result<ChunkView> view = engine.Acquire(0);
    ASSERT_TRUE(view.ok()) << "rank " << r << ": " << view.status().ToString();
    engine.Release(0);
    ASSERT_TRUE(step.get().ok()) << "rank " << r;
    after[size_t(r)] = WorkingParameters(engine);
  });
  EXPECT_TRUE(testing::BitEqual(after[0], after[1]));
}

// A rank whose Acquire fails after the gather (its copy to the device fails) cannot take part
// in the next gathers as the others do: its later Acquires refuse, naming the cause, rather
// than gather another chunk beside the others' and hand them mixed parameters; the others' next
// gather times out.
TEST(ShardingTest, StageThreeRankWhoseAcquireFailsStopsGathering) {
  ScratchDir dir;
  std::vector<Status> first(2), second(2);
  OnStageThreeRanks(dir.path(), 2, [&](int r, Engine& engine, testing::WrappedDevice& device) {
    if (r == 1) device.FailCopiesToDevice(0, 1 << 20);
    first[size_t(r)] = engine.Acquire(0).status();
    if (first[size_t(r)].ok()) engine.Release(0);
    second[size_t(r)] = engine.Acquire(r == 1 ? 0 : 1).status();
  });
  EXPECT_TRUE(first[0].ok()) << first[0].ToString();
  EXPECT_FALSE(first[1].ok());
  EXPECT_EQ(second[1].code(), StatusCode::kFailedPrecondition) << second[1].ToString();
  EXPECT_NE(second[1].message().find("restart the ranks"), std::string::npos)
      << second[1].ToString();
  EXPECT_FALSE(second[0].ok()) << "rank 0 gathered chunk 1 beside rank 1's chunk 0";
}

// A rank that cannot read its parameter shard from NVMe still takes part in the gather (the
// others are in it), and its Acquire fails naming the read. It then stops gathering, as above:
// a retry would gather once more than the other ranks, pairing with their next chunk.
TEST(ShardingTest, StageThreeRankThatCannotReadItsShardFailsItsAcquireAndStopsGathering) {
  ScratchDir dir;
  auto plan = std::make_shared<nvme::FaultPlan>();
  plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kRead, .times = -1});
  std::vector<Status> first(2), second(2);
  OnStageThreeRanks(
      dir.path(), 2,
      [&](int r, Engine& engine, testing::WrappedDevice&) {
        first[size_t(r)] = engine.Acquire(0).status();
        if (first[size_t(r)].ok()) engine.Release(0);
        second[size_t(r)] = engine.Acquire(r == 1 ? 0 : 1).status();
      },
      Tier::kHost, testing::FaultyRankEnvironment(1, plan), Tier::kNvme);
  EXPECT_TRUE(first[0].ok()) << first[0].ToString();
  EXPECT_FALSE(first[1].ok());
  EXPECT_NE(first[1].message().find("reading this rank's shard"), std::string::npos)
      << first[1].ToString();
  EXPECT_NE(first[1].message().find("chunk 0"), std::string::npos) << first[1].ToString();
  EXPECT_EQ(second[1].code(), StatusCode::kFailedPrecondition) << second[1].ToString();
  EXPECT_NE(second[1].message().find("restart the ranks"), std::string::npos)
      << second[1].ToString();
  EXPECT_FALSE(second[0].ok()) << "rank 0 gathered chunk 1 beside rank 1's chunk 0";
}

// After a step that failed (rank 1's NVMe reads fail), stage 3's Acquire refuses on every rank:
// the ranks whose own step succeeded committed it and the others did not, so their shards, and
// their gathers, would differ.
TEST(ShardingTest, StageThreeAcquireAfterAFailedStepIsRefused) {
  ScratchDir dir;
  auto plan = std::make_shared<nvme::FaultPlan>();
  plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kRead, .times = -1});
  std::vector<Status> stepped(2), acquired(2);
  OnStageThreeRanks(
      dir.path(), 30,
      [&](int r, Engine& engine, testing::WrappedDevice&) {
        stepped[size_t(r)] = TrainStep(engine, 0, [&](int s, int m, size_t p, size_t i) {
                               return Grad(r, s, m, p, i);
                             }).status();
        acquired[size_t(r)] = engine.Acquire(0).status();
      },
      Tier::kNvme, testing::FaultyRankEnvironment(1, plan));
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_FALSE(stepped[r].ok()) << "rank " << r;
    EXPECT_EQ(acquired[r].code(), StatusCode::kFailedPrecondition) << "rank " << r;
    EXPECT_NE(acquired[r].message().find("restart the ranks"), std::string::npos)
        << acquired[r].ToString();
  }
}

// Gradient clipping uses the global norm of the mean gradient, all-reduced across ranks; the
// step clips on every rank alike.
void ExpectClippingUsesTheGlobalNorm(int micro_steps);

TEST(ShardingTest, ClippingUsesTheGlobalNormOfTheMeanGradient) {
  for (const int micro_steps : {2, 1}) {
    SCOPED_TRACE(std::to_string(micro_steps) + " micro-steps");
    ExpectClippingUsesTheGlobalNorm(micro_steps);
  }
}

void ExpectClippingUsesTheGlobalNorm(int micro_steps) {
  ScratchDir dir;
  EngineOptions options = OptionsFor({"", Tier::kNvme, 2, micro_steps}, dir.path());
  options.optimizer.gradient_clipping = 0.5;
  constexpr int kSteps = 2;
  constexpr float kScale = 8.0f;  // Norms well above 0.5: every step clips.
  std::vector<RankResult> ranks = TrainSharded(2, options, kSteps, kScale);
  std::vector<StepReport> reference_reports;
  const auto reference = TrainReference(2, options, kSteps, &reference_reports, kScale);
  ASSERT_FALSE(reference.empty());
  for (size_t r = 0; r < ranks.size(); ++r) {
    ASSERT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status.ToString();
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_GT(ranks[r].reports[s].grad_norm, 0.5);
      EXPECT_NEAR(ranks[r].reports[s].grad_norm, reference_reports[s].grad_norm,
                  1e-9 * reference_reports[s].grad_norm);
    }
    // The clip coefficient comes from norms summed in another order: equal to rounding.
    EXPECT_LT(testing::MaxAbsDiff(ranks[r].params, reference), 1e-6) << "rank " << r;
    EXPECT_TRUE(testing::BitEqual(ranks[r].params, ranks[0].params)) << "rank " << r;
  }
}

// A rank whose NVMe fails mid-step fails the step on every rank, at once and naming the cause,
// rather than leaving the others waiting; the step cannot be retried with several ranks.
void ExpectAFailingRankFailsTheStepEverywhere(int micro_steps);

TEST(ShardingTest, AFailingRankFailsTheStepOnEveryRank) {
  for (const int micro_steps : {2, 1}) {
    SCOPED_TRACE(std::to_string(micro_steps) + " micro-steps");
    ExpectAFailingRankFailsTheStepEverywhere(micro_steps);
  }
}

void ExpectAFailingRankFailsTheStepEverywhere(int micro_steps) {
  ScratchDir dir;
  const EngineOptions options = OptionsFor({"", Tier::kNvme, 2, micro_steps}, dir.path());
  auto plan = std::make_shared<nvme::FaultPlan>();
  // Its reads of the states fail: every update of the first step.
  plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kRead, .times = -1});
  std::vector<RankResult> ranks =
      TrainSharded(2, options, 2, 1.0f, testing::FaultyRankEnvironment(1, plan));
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_FALSE(ranks[r].status.ok()) << "rank " << r;
    EXPECT_TRUE(ranks[r].reports.empty()) << "rank " << r;
  }
  EXPECT_NE(ranks[0].status.message().find("rank 1"), std::string::npos)
      << ranks[0].status.message();
}

// A rank that fails after the last collective of a step (its upload of the gathered parameters)
// fails the step on every rank too: the ranks agree on each step's outcome before reporting it,
// rather than the others reporting success and then waiting for it in the next step.
TEST(ShardingTest, ARankThatFailsAfterTheLastGatherFailsTheStepOnEveryRank) {
  ScratchDir dir;
  for (const int micro_steps : {2, 1}) {
    SCOPED_TRACE(std::to_string(micro_steps) + " micro-steps");
    const EngineOptions options = OptionsFor({"", Tier::kHost, 2, micro_steps}, dir.path());
    std::vector<RankResult> ranks =
        TrainSharded(2, options, 2, 1.0f, {}, -1, [](int rank, testing::WrappedDevice& device) {
          if (rank == 1) device.FailCopiesToDevice(0, 1 << 20);
        });
    for (size_t r = 0; r < ranks.size(); ++r) {
      EXPECT_FALSE(ranks[r].status.ok()) << "rank " << r;
      EXPECT_TRUE(ranks[r].reports.empty()) << "rank " << r << " reported a step";
    }
    EXPECT_NE(ranks[0].status.message().find("the step failed on rank 1 of 2"), std::string::npos)
        << ranks[0].status.message();
    EXPECT_NE(ranks[1].status.message().find("injected failure"), std::string::npos)
        << ranks[1].status.message();
  }
}

/// Runs `body` on two sharded engines, each on a thread of its own with `options`, and exits
/// the test binary naming `deadlock` if they are not done within a minute (a hang would stop
/// every later test).
void OnTwoRanksOrExit(const EngineOptions& options, const std::function<void(Engine&)>& body,
                      const char* deadlock) {
  const ShardedModel model;
  auto comms = CreateLocalCommunicators({.size = 2, .timeout_seconds = 30});
  ASSERT_TRUE(comms.ok());
  auto finished = std::async(std::launch::async, [&] {
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        auto device = MakeDevice(64 << 20);
        EngineEnvironment env;
        env.communicator = std::move((*comms)[size_t(r)]);
        auto engine = Engine::Create(options, *device, model.specs, std::move(env));
        ASSERT_TRUE(engine.ok()) << engine.status().ToString();
        body(**engine);
      });
    }
    for (std::thread& thread : threads) thread.join();
  });
  if (finished.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "deadlock: %s\n", deadlock);
    std::_Exit(1);
  }
}

// A trainer that declares a chunk's gradients before its turn (backward's order) and then gives
// up (Step() refuses: the other chunks have none) can still destroy its engine: the journey
// waiting for a reduce-scatter that was never enqueued ends.
TEST(ShardingTest, AnEngineWhoseChunksNeverAllArrivedCanBeDestroyed) {
  ScratchDir dir;
  // Stage 1 accumulates and reduces at the last micro-step; with one micro-step the journey
  // waits earlier, for its ReduceRing slot's turn; stage 2 accumulating reduces every
  // micro-step, and refuses the second (below).
  struct Case {
    int stage;
    int micro_steps;
  };
  for (const Case& test : {Case{1, 2}, Case{2, 1}, Case{2, 2}}) {
    SCOPED_TRACE("stage " + std::to_string(test.stage) + ", " + std::to_string(test.micro_steps) +
                 " micro-steps");
    const EngineOptions options =
        OptionsFor({"", Tier::kHost, test.stage, test.micro_steps}, dir.path());
    OnTwoRanksOrExit(
        options,
        [&](Engine& engine) {
          // Chunk 0 only, in every micro-step: its turn comes after chunks 2 and 1.
          for (int micro = 0; micro < test.micro_steps; ++micro) {
            ASSERT_TRUE(engine.Acquire(0).ok());
            const Status declared = engine.GradsReady(0);
            engine.Release(0);
            if (test.stage == 2 && micro == 1) {
              // Its first micro-step's reduce-scatter cannot be enqueued before chunk 2's: the
              // second would wait for it forever.
              EXPECT_EQ(declared.code(), StatusCode::kFailedPrecondition);
              EXPECT_NE(declared.message().find("chunk 2's are next"), std::string::npos)
                  << declared.ToString();
            } else {
              ASSERT_TRUE(declared.ok()) << declared.ToString();
            }
          }
          EXPECT_EQ(engine.Step().get().status().code(), StatusCode::kFailedPrecondition);
        },
        "destroying an engine waits for a reduce-scatter never queued");
  }
}

// Reducing every micro-step, a refused GradsReady (here: the chunk not acquired) of a later
// micro-step leaves the chunk as it was: the trainer acquires it and declares again, and the
// step completes as if nothing had happened, instead of waiting for a landing never to come.
TEST(ShardingTest, StageTwoGradsReadyRefusedInALaterMicroStepCanBeRetried) {
  ScratchDir dir;
  OnTwoRanksOrExit(
      OptionsFor({"", Tier::kHost, 2, 2}, dir.path()),
      [](Engine& e) {
        for (int micro = 0; micro < 2; ++micro) {
          for (size_t c = e.chunk_count(); c-- > 0;) {
            if (e.layout().chunk(c).frozen) continue;
            if (micro == 1) {
              EXPECT_EQ(e.GradsReady(c).code(), StatusCode::kFailedPrecondition) << "chunk " << c;
            }
            ASSERT_TRUE(e.Acquire(c).ok());
            ASSERT_TRUE(e.GradsReady(c).ok()) << "chunk " << c << ", micro-step " << micro;
            e.Release(c);
          }
        }
        auto report = e.Step().get();
        EXPECT_TRUE(report.ok()) << report.status().ToString();
      },
      "a retried GradsReady waits for a landing that never comes");
}

// What is not built for several ranks says so at Create, or when called.
TEST(ShardingTest, WhatIsNotBuiltForSeveralRanksIsRefusedClearly) {
  ScratchDir dir;
  const ShardedModel model;
  auto create = [&](const EngineOptions& options) {
    auto comms = CreateLocalCommunicators({.size = 2});
    EngineEnvironment env;
    env.communicator = std::move((*comms)[0]);
    auto device = MakeDevice(64 << 20);
    return Engine::Create(options, *device, model.specs, std::move(env)).status();
  };
  // Stage 3 keeps the parameter shards in host memory or on NVMe: on the device is not built.
  EngineOptions stage3 = Stage3Options(Tier::kHost, dir.path());
  stage3.placement.params = Tier::kDevice;
  EXPECT_EQ(create(stage3).code(), StatusCode::kUnavailable);
  EXPECT_NE(create(stage3).message().find("offload_param cpu or nvme"), std::string::npos)
      << create(stage3).message();
  EngineOptions stage0 = ShardedOptions(Tier::kHost, dir.path());
  stage0.placement.zero_stage = 0;
  EXPECT_EQ(create(stage0).code(), StatusCode::kUnavailable);
  EngineOptions params = ShardedOptions(Tier::kHost, dir.path());
  params.placement.params = Tier::kHost;
  EXPECT_EQ(create(params).code(), StatusCode::kUnavailable);
  EngineOptions device_states = ShardedOptions(Tier::kDevice, dir.path());
  EXPECT_EQ(create(device_states).code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace strata::offload
