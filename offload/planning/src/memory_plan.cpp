#include "strata/offload/memory_plan.h"

#include <cmath>

#include "strata/cpu_adam/cpu_optimizer.h"

namespace strata::offload {

Status PlanInput::Validate() const {
  if (!(params > 0) || !std::isfinite(params)) {
    return InvalidArgument("--params must be a positive number of parameters, e.g. 10e9");
  }
  if (gpus < 1) return InvalidArgument("--gpus must be >= 1, got " + std::to_string(gpus));
  if (chunk_bytes == 0) return InvalidArgument("--chunk-size must be positive");
  if (!cpu_adam::IsQuantBits(quantized_gradient_bits)) {
    return InvalidArgument("--zero-quantized-gradient-bits must be 8 or 4, got " +
                           std::to_string(quantized_gradient_bits));
  }
  return Status();
}

double OptimizerBytesPerParam(OptimizerType optimizer, DType working_dtype) {
  // fp32 master + the optimizer's moments, 4 bytes each.
  const double moments = (optimizer == OptimizerType::kAdamW || optimizer == OptimizerType::kAdam)
                             ? 2.0
                             : 1.0;  // Adagrad: sum of squares; Lion: momentum.
  const double master = working_dtype == DType::kFp32 ? 0.0 : 1.0;  // fp32: the params themselves.
  return 4.0 * (master + moments);
}

std::vector<PlanRow> PlanMemory(const PlanInput& in) {
  const double psi = in.params;
  const double n = in.gpus;
  const double w = DTypeSize(in.working_dtype);
  const double k = OptimizerBytesPerParam(in.optimizer, in.working_dtype);

  // Bytes a parameter takes in ZeRO-3's gathers and in its gradient reduction: the working
  // dtype's, or blockwise-quantized values and their share of a block's fp32 scale.
  auto quantized = [](int bits) {
    return bits / 8.0 + double(sizeof(float)) / double(cpu_adam::kQuantBlockElements);
  };
  const double gather_bytes = in.quantized_weights ? quantized(8) : w;
  const double reduce_bytes = in.quantized_gradients ? quantized(in.quantized_gradient_bits) : w;

  auto zero = [&](int stage, const char* name) {
    PlanRow row{.name = name, .zero_stage = stage};
    row.device.params = stage >= 3 ? w * psi / n : w * psi;
    row.device.grads = stage >= 2 ? w * psi / n : w * psi;
    row.device.optimizer_states = stage >= 1 ? k * psi / n : k * psi;
    row.comm_bytes = stage >= 3 ? 2 * psi * gather_bytes + psi * reduce_bytes : 2 * psi * w;
    return row;
  };
  // Optimizer states off the GPU: a GPU reduces its 1/N of the gradients and sends them to host
  // memory, where its share of the states is stepped (read from and written back to NVMe).
  auto offload_optimizer = [&](PlanRow row, Tier tier) {
    row.optimizer_states = tier;
    const double states = row.device.optimizer_states;
    row.device.optimizer_states = 0.0;
    (tier == Tier::kNvme ? row.nvme : row.host).optimizer_states = states;
    row.host.grads = w * psi / n;
    return row;
  };
  // ZeRO-3 parameters off the GPU: they visit it a few chunks at a time.
  auto offload_params = [&](PlanRow row, Tier tier) {
    row.params = tier;
    (tier == Tier::kNvme ? row.nvme : row.host).params = row.device.params;
    row.device.params = 0.0;
    return row;
  };

  std::vector<PlanRow> rows = {zero(0, "data parallel"), zero(1, "ZeRO-1"), zero(2, "ZeRO-2"),
                               zero(3, "ZeRO-3")};
  PlanRow z2_host = offload_optimizer(zero(2, "ZeRO-2, optimizer -> host"), Tier::kHost);
  PlanRow z2_nvme = offload_optimizer(zero(2, "ZeRO-2, optimizer -> nvme"), Tier::kNvme);
  PlanRow z3_host = offload_params(
      offload_optimizer(zero(3, "ZeRO-3, optimizer + params -> host"), Tier::kHost), Tier::kHost);
  PlanRow z3_mixed = offload_params(
      offload_optimizer(zero(3, "ZeRO-3, optimizer -> nvme, params -> host"), Tier::kNvme),
      Tier::kHost);
  PlanRow z3_nvme = offload_params(
      offload_optimizer(zero(3, "ZeRO-3, optimizer + params -> nvme"), Tier::kNvme), Tier::kNvme);
  rows.insert(rows.end(), {z2_host, z2_nvme, z3_host, z3_mixed, z3_nvme});
  return rows;
}

std::optional<PlanRow> SplitStatesAcrossHostAndNvme(const PlanRow& row, int gpus,
                                                    double host_bytes) {
  if (row.optimizer_states != Tier::kNvme || gpus < 1) return std::nullopt;
  const double states = row.nvme.optimizer_states;
  const double room = kHostShareForStates * host_bytes / gpus - row.host.total();
  if (!(room > 0.0) || room >= states) return std::nullopt;
  PlanRow split = row;
  split.host.optimizer_states += room;
  split.nvme.optimizer_states -= room;
  split.name += ", states split host + nvme";
  return split;
}

}  // namespace strata::offload
