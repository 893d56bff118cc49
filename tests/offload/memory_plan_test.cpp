#include "strata/offload/memory_plan.h"

#include <gtest/gtest.h>

namespace strata::offload {
namespace {

const PlanRow& Row(const std::vector<PlanRow>& rows, const std::string& name) {
  for (const PlanRow& r : rows) {
    if (r.name == name) return r;
  }
  ADD_FAILURE() << "no row " << name;
  return rows.front();
}

// The ZeRO paper's figure 1: 7.5B parameters on 64 GPUs, and the 10B on 8.
TEST(MemoryPlanTest, ReproducesTheZeroPaperAccounting) {
  const auto rows = PlanMemory({.params = 10e9, .gpus = 8});
  EXPECT_DOUBLE_EQ(Row(rows, "data parallel").device.total(), 160e9);
  EXPECT_DOUBLE_EQ(Row(rows, "ZeRO-1").device.total(), 55e9);
  EXPECT_DOUBLE_EQ(Row(rows, "ZeRO-2").device.total(), 37.5e9);
  EXPECT_DOUBLE_EQ(Row(rows, "ZeRO-3").device.total(), 20e9);
  EXPECT_DOUBLE_EQ(Row(rows, "ZeRO-2").device.params, 20e9);
  EXPECT_DOUBLE_EQ(Row(rows, "ZeRO-2").device.grads, 2.5e9);
  EXPECT_DOUBLE_EQ(Row(rows, "ZeRO-2").device.optimizer_states, 15e9);
  // fp16: 2 bytes an element, 2 Psi and 3 Psi of them.
  EXPECT_DOUBLE_EQ(Row(rows, "data parallel").comm_bytes, 40e9);
  EXPECT_DOUBLE_EQ(Row(rows, "ZeRO-2").comm_bytes, 40e9);
  EXPECT_DOUBLE_EQ(Row(rows, "ZeRO-3").comm_bytes, 60e9);

  const auto paper = PlanMemory({.params = 7.5e9, .gpus = 64});
  EXPECT_DOUBLE_EQ(Row(paper, "data parallel").device.total(), 120e9);
  EXPECT_DOUBLE_EQ(Row(paper, "ZeRO-1").device.total(), 31.40625e9);
  EXPECT_DOUBLE_EQ(Row(paper, "ZeRO-2").device.total(), 16.640625e9);
  EXPECT_DOUBLE_EQ(Row(paper, "ZeRO-3").device.total(), 1.875e9);
}

// ZeRO++: ZeRO-3's 2 Psi of gathers in int8 and its Psi of reduction in int8 or int4, each 256
// values with a 4-byte scale; the ZeRO++ paper's qwZ + qgZ (without hpZ's backward gathers
// within a node) move 1.5 Psi of bytes for fp16's 6, plus the scales. Other stages unchanged.
TEST(MemoryPlanTest, ZeroPlusPlusQuantizesStageThreesCollectives) {
  const double scale_share = 4.0 / 256;
  PlanInput in{.params = 10e9, .gpus = 8};
  in.quantized_weights = true;
  EXPECT_DOUBLE_EQ(Row(PlanMemory(in), "ZeRO-3").comm_bytes,
                   2 * 10e9 * (1 + scale_share) + 10e9 * 2);
  in.quantized_gradients = true;
  EXPECT_DOUBLE_EQ(Row(PlanMemory(in), "ZeRO-3").comm_bytes,
                   2 * 10e9 * (1 + scale_share) + 10e9 * (1 + scale_share));
  in.quantized_gradient_bits = 4;
  const auto rows = PlanMemory(in);
  EXPECT_DOUBLE_EQ(Row(rows, "ZeRO-3").comm_bytes,
                   2 * 10e9 * (1 + scale_share) + 10e9 * (0.5 + scale_share));
  EXPECT_DOUBLE_EQ(Row(rows, "ZeRO-3, optimizer + params -> nvme").comm_bytes,
                   Row(rows, "ZeRO-3").comm_bytes);
  EXPECT_DOUBLE_EQ(Row(rows, "ZeRO-2").comm_bytes, 40e9);
  in.quantized_gradient_bits = 2;
  EXPECT_EQ(in.Validate().code(), StatusCode::kInvalidArgument);
}

TEST(MemoryPlanTest, OffloadMovesStatesOffTheGpuAndKeepsTheTotal) {
  const auto rows = PlanMemory({.params = 10e9, .gpus = 8});
  const PlanRow& host = Row(rows, "ZeRO-2, optimizer -> host");
  EXPECT_EQ(host.optimizer_states, Tier::kHost);
  EXPECT_DOUBLE_EQ(host.device.total(), 22.5e9);
  EXPECT_DOUBLE_EQ(host.host.optimizer_states, 15e9);
  EXPECT_DOUBLE_EQ(host.host.grads, 2.5e9);  // The GPU's reduced gradients, stepped on the host.
  const PlanRow& nvme = Row(rows, "ZeRO-3, optimizer + params -> nvme");
  EXPECT_DOUBLE_EQ(nvme.device.total(), 2.5e9);
  EXPECT_DOUBLE_EQ(nvme.nvme.total(), 17.5e9);
  EXPECT_DOUBLE_EQ(nvme.host.total(), 2.5e9);
}

TEST(MemoryPlanTest, PrecisionAndOptimizerChangeTheBytesPerParameter) {
  EXPECT_EQ(OptimizerBytesPerParam(OptimizerType::kAdamW, DType::kBf16), 12.0);
  EXPECT_EQ(OptimizerBytesPerParam(OptimizerType::kAdam, DType::kFp32), 8.0);
  EXPECT_EQ(OptimizerBytesPerParam(OptimizerType::kLion, DType::kFp16), 8.0);
  EXPECT_EQ(OptimizerBytesPerParam(OptimizerType::kAdagrad, DType::kFp32), 4.0);
  // fp32 Adam: 4 + 4 + 8 = 16 bytes per parameter, as fp16 mixed precision.
  EXPECT_DOUBLE_EQ(PlanMemory({.params = 1e9, .working_dtype = DType::kFp32})[0].device.total(),
                   16e9);
}

TEST(MemoryPlanTest, StatesSplitAcrossHostAndNvmeFillWhatHostMemoryHolds) {
  // 10e9 fp16 AdamW parameters on one GPU, states on NVMe: 120 GB of states, 20 GB of
  // gradients in host memory.
  const std::vector<PlanRow> rows = PlanMemory({.params = 10e9, .gpus = 1});
  const PlanRow* nvme = nullptr;
  for (const PlanRow& row : rows) {
    if (row.name == "ZeRO-2, optimizer -> nvme") nvme = &row;
  }
  ASSERT_NE(nvme, nullptr);
  const std::optional<PlanRow> split = SplitStatesAcrossHostAndNvme(*nvme, 1, 100e9);
  ASSERT_TRUE(split.has_value());
  EXPECT_EQ(split->name, "ZeRO-2, optimizer -> nvme, states split host + nvme");
  EXPECT_DOUBLE_EQ(split->host.optimizer_states, 0.9 * 100e9 - 20e9);
  EXPECT_DOUBLE_EQ(split->nvme.optimizer_states, 120e9 - 70e9);
  EXPECT_DOUBLE_EQ(split->host.total() + split->nvme.total(),
                   nvme->host.total() + nvme->nvme.total());
  // All fit (the host row is the one), none fit, or states not on NVMe: no split row.
  EXPECT_FALSE(SplitStatesAcrossHostAndNvme(*nvme, 1, 1000e9).has_value());
  EXPECT_FALSE(SplitStatesAcrossHostAndNvme(*nvme, 1, 10e9).has_value());
  EXPECT_FALSE(SplitStatesAcrossHostAndNvme(rows[2], 1, 100e9).has_value());
  // Per GPU: eight GPUs share the node's host memory.
  const std::vector<PlanRow> eight = PlanMemory({.params = 10e9, .gpus = 8});
  for (const PlanRow& row : eight) {
    if (row.name != "ZeRO-2, optimizer -> nvme") continue;
    const auto shared = SplitStatesAcrossHostAndNvme(row, 8, 100e9);
    ASSERT_TRUE(shared.has_value());
    EXPECT_DOUBLE_EQ(shared->host.optimizer_states, 0.9 * 100e9 / 8 - 20e9 / 8);
  }
}

TEST(MemoryPlanTest, BadInputIsRejected) {
  EXPECT_EQ(PlanInput{.params = 0}.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((PlanInput{.params = 1e9, .gpus = 0}).Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE((PlanInput{.params = 1e9, .gpus = 4}).Validate().ok());
}

}  // namespace
}  // namespace strata::offload
