// `strata plan`: per-GPU memory of model state and communication per step under data
// parallelism, each ZeRO stage and the offload placements, before buying or renting hardware.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "strata/offload/memory_plan.h"

namespace strata::tools {
namespace {

using offload::PlanInput;
using offload::PlanRow;

/// Decimal gigabytes, as GPU memory is usually quoted; "-" for nothing.
std::string Gb(double bytes) {
  if (bytes <= 0) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", bytes / 1e9);
  return text;
}

nlohmann::ordered_json ToJson(const PlanInput& in, const std::vector<PlanRow>& rows) {
  auto bytes = [](const offload::StateBytes& s) {
    return nlohmann::ordered_json{{"params", s.params},
                                  {"grads", s.grads},
                                  {"optimizer_states", s.optimizer_states},
                                  {"total", s.total()}};
  };
  nlohmann::ordered_json j;
  j["params"] = in.params;
  j["gpus"] = in.gpus;
  j["precision"] = DTypeName(in.working_dtype);
  j["optimizer"] = OptimizerTypeName(in.optimizer);
  j["optimizer_bytes_per_param"] = offload::OptimizerBytesPerParam(in.optimizer, in.working_dtype);
  nlohmann::ordered_json placements = nlohmann::ordered_json::array();
  for (const PlanRow& r : rows) {
    placements.push_back({{"name", r.name},
                          {"zero_stage", r.zero_stage},
                          {"optimizer_states", TierName(r.optimizer_states)},
                          {"params_tier", TierName(r.params)},
                          {"device_bytes", bytes(r.device)},
                          {"host_bytes", bytes(r.host)},
                          {"nvme_bytes", bytes(r.nvme)},
                          {"comm_elements_per_step", r.comm_elements},
                          {"comm_bytes_per_step", r.comm_elements * DTypeSize(in.working_dtype)}});
  }
  j["placements"] = std::move(placements);
  return j;
}

void PrintTable(const PlanInput& in, const std::vector<PlanRow>& rows) {
  std::printf(
      "Model state per GPU: %.4g parameters on %d GPUs, %s working copy, %s "
      "(%.0f optimizer bytes per parameter)\n\n",
      in.params, in.gpus, std::string(DTypeName(in.working_dtype)).c_str(),
      std::string(OptimizerTypeName(in.optimizer)).c_str(),
      offload::OptimizerBytesPerParam(in.optimizer, in.working_dtype));
  std::printf("  %-36s %8s %8s %8s %8s   %8s %8s   %s\n", "", "params", "grads", "optim", "GPU GB",
              "host GB", "nvme GB", "comm/step");
  for (const PlanRow& r : rows) {
    const double psi_multiple = r.comm_elements / in.params;
    std::printf("  %-36s %8s %8s %8s %8s   %8s %8s   %.0f Psi (%s GB)\n", r.name.c_str(),
                Gb(r.device.params).c_str(), Gb(r.device.grads).c_str(),
                Gb(r.device.optimizer_states).c_str(), Gb(r.device.total()).c_str(),
                Gb(r.host.total()).c_str(), Gb(r.nvme.total()).c_str(), psi_multiple,
                Gb(r.comm_elements * DTypeSize(in.working_dtype)).c_str());
  }
  std::printf(
      "\nModel state only: activations, buffers and fragmentation come on top. "
      "Offloaded parameters visit the GPU a few chunks at a time (counted as 0).\n");
}

}  // namespace

int RunPlan(const std::vector<std::string>& args) {
  const std::string command = "strata plan";
  double params = 0.0;
  int64_t gpus = 1;
  std::string precision = "fp16", optimizer = "adamw";
  bool json = false;
  FlagParser flags(command,
                   "Per-GPU memory of parameters, gradients and optimizer states, and "
                   "communication per step, for data parallelism, ZeRO-1/2/3 and the offload "
                   "placements (the ZeRO paper's accounting).");
  flags.AddDouble("params", &params, "parameter count, e.g. 10e9 (required)");
  flags.AddInt("gpus", &gpus, "data-parallel GPUs (default 1)");
  flags.AddString("precision", &precision, "DTYPE", "working dtype: fp16 (default), bf16, fp32");
  flags.AddString("optimizer", &optimizer, "NAME", "adamw (default), adam, adagrad or lion");
  flags.AddBool("json", &json, "print one JSON document instead of a table");
  if (Status s = flags.Parse(args); !s.ok()) return Fail(kExitUsage, s.message(), command);
  if (flags.help_requested()) {
    std::cout << flags.Help();
    return kExitOk;
  }
  PlanInput input{.params = params, .gpus = int(std::clamp<int64_t>(gpus, 0, 1 << 24))};
  auto dtype = ParseDType(precision);
  if (!dtype.ok()) return Fail(kExitUsage, dtype.status().message(), command);
  auto type = ParseOptimizerType(optimizer);
  if (!type.ok()) return Fail(kExitUsage, type.status().message(), command);
  input.working_dtype = *dtype;
  input.optimizer = *type;
  if (Status s = input.Validate(); !s.ok()) return Fail(kExitUsage, s.message(), command);
  const std::vector<PlanRow> rows = offload::PlanMemory(input);
  if (json) {
    std::cout << ToJson(input, rows).dump(2) << "\n";
  } else {
    PrintTable(input, rows);
  }
  return kExitOk;
}

}  // namespace strata::tools
