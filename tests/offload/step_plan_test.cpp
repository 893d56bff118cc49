#include "strata/offload/step_plan.h"

#include <gtest/gtest.h>

#include "strata/core/bytes.h"

namespace strata::offload {
namespace {

// 1e9 bf16 parameters with AdamW on one GPU; rates chosen so each placement has a clear bound.
const PlanInput kModel{.params = 1e9, .gpus = 1, .working_dtype = DType::kBf16};
const MachineRates kRates{.host_to_device_bytes_per_second = 20e9,
                          .device_to_host_bytes_per_second = 20e9,
                          .nvme_read_bytes_per_second = 4e9,
                          .nvme_write_bytes_per_second = 2e9,
                          .optimizer_params_per_second = 1e9,
                          .compute_seconds = 3.0};

struct Planned {
  std::vector<PlanRow> rows;
  std::vector<StepPrediction> predictions;
  const StepPrediction& Of(const std::string& name) const {
    for (size_t i = 0; i < rows.size(); ++i) {
      if (rows[i].name == name) return predictions[i];
    }
    ADD_FAILURE() << "no row " << name;
    return predictions.front();
  }
  std::string Chosen() const {
    const int i = ChoosePlacement(predictions);
    return i < 0 ? "none" : rows[i].name;
  }
};

Planned Plan(const PlanInput& in, const MachineRates& rates, const MachineMemory& memory = {}) {
  Planned p{.rows = PlanMemory(in)};
  for (const PlanRow& row : p.rows) p.predictions.push_back(PredictStep(in, row, rates, memory));
  return p;
}

double Seconds(const StepPrediction& p, const std::string& resource) {
  for (const ResourceSeconds& r : p.resources) {
    if (r.name == resource) return r.seconds;
  }
  return -1.0;
}

TEST(StepPlanTest, EachPlacementCostsForwardPlusTheLongerOfBackwardAndTheUpdate) {
  const Planned plan = Plan(kModel, kRates);
  // Nothing offloaded: compute alone, a third forward and two thirds backward.
  const StepPrediction& dp = plan.Of("data parallel");
  EXPECT_DOUBLE_EQ(dp.step_seconds, 3.0);
  EXPECT_EQ(dp.bound_by, "compute");
  EXPECT_EQ(dp.resources.size(), 1u);

  // States on host: the update (CPU Adam, 1 s) hides behind backward (2 s).
  const StepPrediction& host = plan.Of("ZeRO-2, optimizer -> host");
  EXPECT_DOUBLE_EQ(Seconds(host, "device_to_host"), 0.1);  // 2 GB of gradients at 20 GB/s.
  EXPECT_DOUBLE_EQ(Seconds(host, "host_to_device"), 0.1);  // The new parameters.
  EXPECT_DOUBLE_EQ(Seconds(host, "cpu_optimizer"), 1.0);
  EXPECT_DOUBLE_EQ(host.update_seconds, 1.0);
  EXPECT_DOUBLE_EQ(host.step_seconds, 3.0);

  // States on NVMe: 12 GB read at 4 GB/s plus 12 GB written at 2 GB/s outlast backward. The
  // reads run ahead of backward (host memory unknown: a staging buffer for every chunk), so
  // forward's second of them leaves the update and the step costs the drives' 9 s. The new
  // parameters (0.1 s) go up in the pipeline, as each chunk's update completes.
  const StepPrediction& nvme = plan.Of("ZeRO-2, optimizer -> nvme");
  EXPECT_DOUBLE_EQ(Seconds(nvme, "nvme"), 9.0);
  EXPECT_DOUBLE_EQ(Seconds(nvme, "host_to_device"), 0.1);
  EXPECT_DOUBLE_EQ(nvme.update_seconds, 9.0 - 1.0);
  EXPECT_DOUBLE_EQ(nvme.commit_seconds, 0.0);
  EXPECT_DOUBLE_EQ(nvme.step_seconds, 9.0);
  EXPECT_EQ(nvme.bound_by, "nvme");

  // Parameters on NVMe too: fetched in forward and backward (4 GB read, 1 s), written once
  // (2 GB, 1 s). Backward's half of the fetches shares the drives with the update; the states'
  // reads ahead take forward's second: 1 + 9.5 s, which the drives' own 11 s outlast.
  const StepPrediction& all = plan.Of("ZeRO-3, optimizer + params -> nvme");
  EXPECT_DOUBLE_EQ(Seconds(all, "nvme"), 1.0 + 9.0 + 1.0);
  EXPECT_DOUBLE_EQ(Seconds(all, "host_to_device"), 0.2);  // Fetches only; no update upload.
  EXPECT_DOUBLE_EQ(all.update_seconds, 0.5 + 9.0 + 1.0 - 1.0);
  EXPECT_DOUBLE_EQ(all.step_seconds, 11.0);
  EXPECT_TRUE(all.unknown.empty());
}

TEST(StepPlanTest, ADelayedUpdateHasTheWholeStepToRunIn) {
  // CPU Adam at 0.4e9 params/s: 2.5 s, longer than backward (2 s), shorter than compute (3 s).
  MachineRates slow_cpu = kRates;
  slow_cpu.optimizer_params_per_second = 0.4e9;
  EXPECT_DOUBLE_EQ(Plan(kModel, slow_cpu).Of("ZeRO-2, optimizer -> host").step_seconds, 1 + 2.5);
  PlanInput delayed = kModel;
  delayed.delayed_update = true;
  EXPECT_DOUBLE_EQ(Plan(delayed, slow_cpu).Of("ZeRO-2, optimizer -> host").step_seconds, 3.0);
  // Longer than compute, it bounds the step; nothing offloaded, nothing changes.
  slow_cpu.optimizer_params_per_second = 0.25e9;
  EXPECT_DOUBLE_EQ(Plan(delayed, slow_cpu).Of("ZeRO-2, optimizer -> host").step_seconds, 4.0);
  EXPECT_DOUBLE_EQ(Plan(delayed, slow_cpu).Of("data parallel").step_seconds, 3.0);
}

TEST(StepPlanTest, StateReadsAheadOfBackwardAreBoundedByTheStagingTheHostHolds) {
  // 12 GB of states in 64 MiB bf16 chunks: 30 chunks of 384 MiB. A 3.5 GB host leaves the
  // engine 2.8 GB less 2 GB of gradients: 0.8 GB holds fewer than the 4 buffers it always takes:
  // 3 of the 30 chunks' reads (0.3 s of 3 s) run ahead.
  const PlanRow row = [] {
    for (const PlanRow& r : PlanMemory(kModel)) {
      if (r.name == "ZeRO-2, optimizer -> nvme") return r;
    }
    return PlanRow{};
  }();
  const StepPrediction tight = PredictStep(kModel, row, kRates, {.host_bytes = 3.5e9});
  EXPECT_DOUBLE_EQ(tight.update_seconds, 9.0 - 0.3);
  EXPECT_DOUBLE_EQ(tight.step_seconds, 1.0 + 8.7);
  // Chunks 4x smaller: 120 of 96 MiB; 0.8 GB holds 7 buffers, 6 chunks read ahead.
  PlanInput small = kModel;
  small.chunk_bytes = 16 * kMiB;
  const StepPrediction many = PredictStep(small, row, kRates, {.host_bytes = 3.5e9});
  EXPECT_DOUBLE_EQ(many.update_seconds, 9.0 - 3.0 * 6 / 120);
  // With speculative updates of clipped steps, the parameters from before of the 30 chunks
  // (2 GB) come first: a 6.5 GB host leaves 5.2 - 2 - 2 = 1.2 GB, 2 buffers, so 4 again;
  // unclipped, staging takes all 3.2 GB: 7 buffers, 6 chunks (0.6 s) ahead.
  PlanInput speculating = kModel;
  speculating.gradient_clipping = 1.0;
  EXPECT_DOUBLE_EQ(PredictStep(speculating, row, kRates, {.host_bytes = 6.5e9}).update_seconds,
                   9.0 - 0.3);
  EXPECT_DOUBLE_EQ(PredictStep(kModel, row, kRates, {.host_bytes = 6.5e9}).update_seconds, 8.4);
  // Room for every chunk: forward's second of reads runs ahead.
  EXPECT_DOUBLE_EQ(PredictStep(kModel, row, kRates, {.host_bytes = 1e12}).update_seconds, 8.0);
  // An update that waits for backward's end (no speculation on a gated step) reads during
  // backward too: all 3 s of reads are done before it starts.
  PlanInput gated = kModel;
  gated.gradient_clipping = 1.0;
  gated.speculative_updates = false;
  const StepPrediction waiting = PredictStep(gated, row, kRates, {});
  EXPECT_DOUBLE_EQ(waiting.update_seconds, 6.0);
  EXPECT_DOUBLE_EQ(waiting.step_seconds, 1.0 + 2.0 + 6.0);
}

TEST(StepPlanTest, GatedStepsUpdateDuringBackwardOnlyWithSpeculation) {
  // fp16 checks every gradient for overflow, clipping needs the global norm. Without
  // speculation no update starts before backward ends, so the update adds to it.
  PlanInput fp16 = kModel;
  fp16.working_dtype = DType::kFp16;
  fp16.speculative_updates = false;
  EXPECT_DOUBLE_EQ(Plan(fp16, kRates).Of("ZeRO-2, optimizer -> host").step_seconds, 1 + 2 + 1.0);
  PlanInput clipped = kModel;
  clipped.gradient_clipping = 1.0;
  clipped.speculative_updates = false;
  EXPECT_DOUBLE_EQ(Plan(clipped, kRates).Of("ZeRO-2, optimizer -> host").step_seconds, 1 + 2 + 1.0);
  EXPECT_DOUBLE_EQ(Plan(kModel, kRates).Of("ZeRO-2, optimizer -> host").step_seconds, 3.0);

  // With it (the default) the update hides behind backward again, as in an ungated step.
  clipped.speculative_updates = true;
  fp16.speculative_updates = true;
  for (const PlanInput& gated : {clipped, fp16}) {
    const Planned speculative = Plan(gated, kRates);
    const Planned ungated = Plan(kModel, kRates);
    for (const char* row : {"ZeRO-2, optimizer -> host", "ZeRO-2, optimizer -> nvme"}) {
      EXPECT_DOUBLE_EQ(speculative.Of(row).step_seconds, ungated.Of(row).step_seconds) << row;
    }
  }
}

TEST(StepPlanTest, NoStepIsShorterThanItsBusiestResource) {
  // Whatever overlaps, a resource cannot do its step's work in less than its own time.
  for (double compute : {0.0, 0.3, 3.0, 30.0}) {
    for (double nvme_read : {0.5e9, 4e9}) {
      MachineRates rates = kRates;
      rates.compute_seconds = compute;
      rates.nvme_read_bytes_per_second = nvme_read;
      const Planned plan = Plan(kModel, rates);
      for (size_t i = 0; i < plan.rows.size(); ++i) {
        for (const ResourceSeconds& r : plan.predictions[i].resources) {
          EXPECT_GE(plan.predictions[i].step_seconds, r.seconds)
              << plan.rows[i].name << ", " << r.name << ", compute " << compute;
        }
      }
    }
  }
}

TEST(StepPlanTest, SlowFetchesStretchForwardAndBackward) {
  MachineRates slow_link = kRates;
  slow_link.host_to_device_bytes_per_second = 1e9;  // 4 GB of fetches take 4 s.
  const StepPrediction p = Plan(kModel, slow_link).Of("ZeRO-3, optimizer + params -> host");
  EXPECT_DOUBLE_EQ(p.forward_seconds, 2.0);
  EXPECT_DOUBLE_EQ(p.backward_seconds, 2.0);
  EXPECT_DOUBLE_EQ(p.step_seconds, 4.0);
  EXPECT_EQ(p.bound_by, "host_to_device");
}

TEST(StepPlanTest, CollectivesCountOnTheLinkWithSeveralGpus) {
  MachineRates rates = kRates;
  rates.link_bytes_per_second = 100e9;
  const PlanInput eight{.params = 10e9, .gpus = 8, .working_dtype = DType::kFp16};
  const Planned plan = Plan(eight, rates);
  EXPECT_DOUBLE_EQ(Seconds(plan.Of("data parallel"), "link"), 2 * 10e9 * 2 / 100e9);
  EXPECT_DOUBLE_EQ(Seconds(plan.Of("ZeRO-3"), "link"), 3 * 10e9 * 2 / 100e9);
  // The node's CPU steps all eight shards; each GPU sends only its own gradients.
  const StepPrediction& host = plan.Of("ZeRO-2, optimizer -> host");
  EXPECT_DOUBLE_EQ(Seconds(host, "cpu_optimizer"), 10.0);
  EXPECT_DOUBLE_EQ(Seconds(host, "device_to_host"), 10e9 * 2 / 8 / 20e9);
}

TEST(StepPlanTest, ASplitPlacementPaysNvmeOnlyForWhatIsThere) {
  const std::vector<PlanRow> rows = PlanMemory(kModel);
  for (const PlanRow& row : rows) {
    if (row.name != "ZeRO-2, optimizer -> nvme") continue;
    // 12 GB of states; 9 GB of a 10 GB host less 2 GB of gradients hold 7 GB of them.
    const std::optional<PlanRow> split = SplitStatesAcrossHostAndNvme(row, 1, 10e9);
    ASSERT_TRUE(split.has_value());
    const StepPrediction all = PredictStep(kModel, row, kRates, {});
    const StepPrediction part = PredictStep(kModel, *split, kRates, {});
    // NVMe: 12/4 + 12/2 = 9 s for all of it, 5/4 + 5/2 = 3.75 s for the 5 GB left.
    EXPECT_DOUBLE_EQ(Seconds(all, "nvme"), 9.0);
    EXPECT_DOUBLE_EQ(Seconds(part, "nvme"), 3.75);
    // Its 1.25 s of reads run ahead, forward's second of them before backward: the drives'.
    EXPECT_DOUBLE_EQ(part.step_seconds, 3.75);
    // It fits where the all-host row does not.
    const MachineMemory small_host{.host_bytes = 10e9};
    EXPECT_TRUE(PredictStep(kModel, *split, kRates, small_host).fits);
  }
}

TEST(StepPlanTest, PicksTheFastestPlacementThatFits) {
  // Everything fits: keeping all on the GPU is fastest (ties go to the less offloaded row).
  EXPECT_EQ(Plan(kModel, kRates).Chosen(), "data parallel");
  // 10 GB of GPU: 16 GB of model state does not fit; states on host do (4 GB on the GPU).
  const Planned gpu = Plan(kModel, kRates, {.device_bytes = 10e9});
  EXPECT_FALSE(gpu.Of("data parallel").fits);
  EXPECT_NE(gpu.Of("data parallel").why_not.find("GPU needs"), std::string::npos);
  EXPECT_EQ(gpu.Chosen(), "ZeRO-2, optimizer -> host");
  // Too little host memory for 12 GB of states and 2 GB of gradients: to NVMe.
  const Planned host = Plan(kModel, kRates, {.device_bytes = 10e9, .host_bytes = 8e9});
  EXPECT_EQ(host.Chosen(), "ZeRO-2, optimizer -> nvme");
  // NVMe holds two copies of the states (the shadow a step writes): 24 GB needed.
  const Planned nvme =
      Plan(kModel, kRates, {.device_bytes = 10e9, .host_bytes = 8e9, .nvme_bytes = 20e9});
  EXPECT_EQ(nvme.Chosen(), "none");
  EXPECT_NE(nvme.Of("ZeRO-2, optimizer -> nvme").why_not.find("nvme needs"), std::string::npos);
}

TEST(StepPlanTest, UnknownRatesAreNamedAndOnlyCompeteWhenNothingElseFits) {
  const StepPrediction p =
      Plan(kModel, {.compute_seconds = 3.0}).Of("ZeRO-3, optimizer + params -> nvme");
  EXPECT_EQ(p.unknown, (std::vector<std::string>{"host->device", "nvme read", "device->host",
                                                 "optimizer params/s", "nvme write"}));
  EXPECT_DOUBLE_EQ(p.step_seconds, 3.0);  // A lower bound: compute alone, the rest unknown.

  // Without NVMe rates the NVMe rows look as fast as the host rows; they are not chosen while
  // a row with every rate known fits, and are (as lower bounds) once none does.
  MachineRates no_nvme = kRates;
  no_nvme.nvme_read_bytes_per_second = 0.0;
  no_nvme.nvme_write_bytes_per_second = 0.0;
  no_nvme.compute_seconds = 30.0;  // Hides the known update stages.
  EXPECT_EQ(Plan(kModel, no_nvme, {.device_bytes = 10e9}).Chosen(), "ZeRO-2, optimizer -> host");
  EXPECT_EQ(Plan(kModel, no_nvme, {.device_bytes = 10e9, .host_bytes = 8e9}).Chosen(),
            "ZeRO-2, optimizer -> nvme");
}

}  // namespace
}  // namespace strata::offload
