// `strata plan`: per-GPU memory of model state and communication per step under data
// parallelism, each ZeRO stage and the offload placements, before buying or renting hardware;
// given a machine's memory and rates (or --measure), each placement's step time per resource and
// the fastest placement that fits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "launcher.h"
#include "plan_measure.h"
#include "strata/core/bytes.h"
#include "strata/offload/memory_plan.h"
#include "strata/offload/mpi_communicator.h"
#include "strata/offload/ranks.h"
#include "strata/offload/step_plan.h"

namespace strata::tools {
namespace {

using offload::MachineMemory;
using offload::MachineRates;
using offload::PlanInput;
using offload::PlanRow;
using offload::StepPrediction;

/// The machine as the flags describe it: rates in GB/s (1e9 bytes), 0 = not given.
struct MachineFlags {
  uint64_t device_memory = 0, host_memory = 0, nvme_bytes = 0, chunk_size = 0;
  double h2d_gbps = 0, d2h_gbps = 0, nvme_read_gbps = 0, nvme_write_gbps = 0, optimizer_gparams = 0,
         link_gbps = 0, compute_seconds = 0, tokens = 0, tflops = 0;
  double gradient_clipping = 0;
  bool measure = false, no_speculation = false, delayed_update = false;
  std::string nvme_path;

  /// Whether any flag asks for step times and a placement choice.
  bool given() const {
    return measure || device_memory || host_memory || nvme_bytes || h2d_gbps || d2h_gbps ||
           nvme_read_gbps || nvme_write_gbps || optimizer_gparams || link_gbps || compute_seconds ||
           tokens || tflops;
  }
};

Status ValidateMachine(const MachineFlags& m) {
  const std::pair<const char*, double> numbers[] = {{"--h2d-gbps", m.h2d_gbps},
                                                    {"--d2h-gbps", m.d2h_gbps},
                                                    {"--nvme-read-gbps", m.nvme_read_gbps},
                                                    {"--nvme-write-gbps", m.nvme_write_gbps},
                                                    {"--optimizer-gparams", m.optimizer_gparams},
                                                    {"--link-gbps", m.link_gbps},
                                                    {"--compute-seconds", m.compute_seconds},
                                                    {"--tokens", m.tokens},
                                                    {"--tflops", m.tflops},
                                                    {"--gradient-clipping", m.gradient_clipping}};
  for (const auto& [flag, value] : numbers) {
    if (!(value >= 0) || !std::isfinite(value)) {
      return InvalidArgument(std::string(flag) + " must be a number >= 0");
    }
  }
  if ((m.tokens > 0) != (m.tflops > 0)) {
    return InvalidArgument(
        "--tokens and --tflops go together (compute = 6 x params x tokens / "
        "FLOP/s)");
  }
  if (m.compute_seconds > 0 && m.tokens > 0) {
    return InvalidArgument("give --compute-seconds or --tokens with --tflops, not both");
  }
  if (!m.measure && !m.nvme_path.empty()) {
    return InvalidArgument("--nvme-path is a setting of --measure");
  }
  if (m.chunk_size % (4 * kKiB) != 0) {
    return InvalidArgument("--chunk-size must be a multiple of 4KiB");
  }
  if (!m.nvme_path.empty() && !std::filesystem::is_directory(m.nvme_path)) {
    return InvalidArgument("--nvme-path " + m.nvme_path + " is not a directory");
  }
  return Status();
}

/// The flags' rates; --measure measures those not given: the link with `ranks` (several ranks,
/// every one measuring alike), the node's rates on the first rank only (ranks sharing a node
/// would measure each other).
Result<MachineRates> RatesFor(const MachineFlags& m, const PlanInput& in, bool first,
                              offload::Communicator* ranks) {
  MachineRates r;
  if (m.measure) {
    MeasureSettings settings{
        .nvme_path = m.nvme_path.empty() ? TempDirectory() : m.nvme_path,
        .chunk_bytes = in.chunk_bytes,
        .working_dtype = in.working_dtype,
        .params = in.params,
        .copies = first && !(m.h2d_gbps > 0 && m.d2h_gbps > 0),
        .states =
            first && !(m.nvme_read_gbps > 0 && m.nvme_write_gbps > 0 && m.optimizer_gparams > 0),
        .ranks = m.link_gbps > 0 ? nullptr : ranks,
        .progress = first
                        ? [](const std::string&
                                 line) { std::fprintf(stderr, "strata plan: %s\n", line.c_str()); }
                        : std::function<void(const std::string&)>()};
    STRATA_ASSIGN_OR_RETURN(r, MeasureRates(settings));
  }
  auto given = [](double gbps, double& rate) {
    if (gbps > 0) rate = gbps * 1e9;
  };
  given(m.h2d_gbps, r.host_to_device_bytes_per_second);
  given(m.d2h_gbps, r.device_to_host_bytes_per_second);
  given(m.nvme_read_gbps, r.nvme_read_bytes_per_second);
  given(m.nvme_write_gbps, r.nvme_write_bytes_per_second);
  given(m.optimizer_gparams, r.optimizer_params_per_second);
  given(m.link_gbps, r.link_bytes_per_second);
  // Forward and backward do about 6 FLOPs per parameter per token.
  r.compute_seconds =
      m.tokens > 0 ? 6.0 * in.params * m.tokens / (m.tflops * 1e12) : m.compute_seconds;
  return r;
}

/// Decimal gigabytes, as GPU memory is usually quoted; "-" for nothing.
std::string Gb(double bytes) {
  if (bytes <= 0) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", bytes / 1e9);
  return text;
}

/// The placement.max_states_in_host a split row runs with (per GPU); 0 for the others.
uint64_t MaxStatesInHost(const PlanRow& row) {
  const bool split = row.optimizer_states == Tier::kNvme && row.host.optimizer_states > 0;
  return split ? uint64_t(row.host.optimizer_states) : 0;
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
  j["quantized_weights"] = in.quantized_weights;
  j["quantized_gradients"] = in.quantized_gradients;
  j["quantized_gradient_bits"] = in.quantized_gradient_bits;
  nlohmann::ordered_json placements = nlohmann::ordered_json::array();
  for (const PlanRow& r : rows) {
    placements.push_back({{"name", r.name},
                          {"zero_stage", r.zero_stage},
                          {"optimizer_states", TierName(r.optimizer_states)},
                          {"params_tier", TierName(r.params)},
                          {"max_states_in_host", MaxStatesInHost(r)},
                          {"device_bytes", bytes(r.device)},
                          {"host_bytes", bytes(r.host)},
                          {"nvme_bytes", bytes(r.nvme)},
                          {"comm_elements_per_step", r.comm_bytes / DTypeSize(in.working_dtype)},
                          {"comm_bytes_per_step", r.comm_bytes}});
  }
  j["placements"] = std::move(placements);
  return j;
}

nlohmann::ordered_json ToJson(const StepPrediction& p) {
  nlohmann::ordered_json resources = nlohmann::ordered_json::object();
  for (const auto& r : p.resources) resources[r.name] = r.seconds;
  return {{"fits", p.fits},
          {"why_not", p.why_not},
          {"resources_seconds", resources},
          {"forward_seconds", p.forward_seconds},
          {"backward_seconds", p.backward_seconds},
          {"update_seconds", p.update_seconds},
          {"commit_seconds", p.commit_seconds},
          {"step_seconds", p.step_seconds},
          {"bound_by", p.bound_by},
          {"unknown_rates", p.unknown}};
}

/// Adds the machine, each placement's prediction and the choice to the plan's JSON.
void AddPredictions(nlohmann::ordered_json& j, const MachineRates& r, const MachineMemory& m,
                    const std::vector<PlanRow>& rows,
                    const std::vector<StepPrediction>& predictions, int chosen) {
  j["machine"] = {{"device_memory_bytes", m.device_bytes},
                  {"host_memory_bytes", m.host_bytes},
                  {"nvme_bytes", m.nvme_bytes},
                  {"host_to_device_bytes_per_second", r.host_to_device_bytes_per_second},
                  {"device_to_host_bytes_per_second", r.device_to_host_bytes_per_second},
                  {"nvme_read_bytes_per_second", r.nvme_read_bytes_per_second},
                  {"nvme_write_bytes_per_second", r.nvme_write_bytes_per_second},
                  {"optimizer_params_per_second", r.optimizer_params_per_second},
                  {"link_bytes_per_second", r.link_bytes_per_second},
                  {"compute_seconds", r.compute_seconds}};
  for (size_t i = 0; i < rows.size(); ++i) {
    j["placements"][i]["prediction"] = ToJson(predictions[i]);
  }
  j["chosen"] = chosen >= 0 ? nlohmann::ordered_json(rows[chosen].name) : nullptr;
}

std::string Rate(double bytes_per_second) {
  return bytes_per_second > 0 ? FormatBandwidth(bytes_per_second) : "?";
}

std::string SecondsOf(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.4f", seconds);
  return text;
}

/// Seconds of one resource, "-" when the placement does not use it.
std::string SecondsOf(const StepPrediction& p, const char* name) {
  for (const auto& r : p.resources) {
    if (r.name == name) return SecondsOf(r.seconds);
  }
  return "-";
}

void PrintPredictions(const MachineRates& r, const MachineMemory& m,
                      const std::vector<PlanRow>& rows,
                      const std::vector<StepPrediction>& predictions, int chosen) {
  auto limit = [](double bytes) {
    return bytes > 0 ? FormatBytes(uint64_t(bytes)) : std::string("not limited");
  };
  std::printf(
      "\nStep time per resource, seconds (step = forward + max(backward, update) + commit; with "
      "fp16 or clipping and --no-speculation, forward + backward + update + commit):\n");
  std::printf("  memory: GPU %s, host %s, nvme %s\n", limit(m.device_bytes).c_str(),
              limit(m.host_bytes).c_str(), limit(m.nvme_bytes).c_str());
  std::printf(
      "  rates: host->device %s, device->host %s, nvme read %s, write %s, optimizer "
      "%.3g params/s, link %s; compute %.4g s\n\n",
      Rate(r.host_to_device_bytes_per_second).c_str(),
      Rate(r.device_to_host_bytes_per_second).c_str(), Rate(r.nvme_read_bytes_per_second).c_str(),
      Rate(r.nvme_write_bytes_per_second).c_str(), r.optimizer_params_per_second,
      Rate(r.link_bytes_per_second).c_str(), r.compute_seconds);
  std::printf("    %-42s %4s %8s %8s %8s %8s %8s %8s %10s  %s\n", "", "fits", "compute", "d2h",
              "h2d", "nvme", "cpu opt", "link", "step", "bound by");
  for (size_t i = 0; i < rows.size(); ++i) {
    const StepPrediction& p = predictions[i];
    const std::string step = (p.unknown.empty() ? "" : ">=") + SecondsOf(p.step_seconds);
    std::printf("  %c %-42s %4s %8s %8s %8s %8s %8s %8s %10s  %s\n", int(i) == chosen ? '*' : ' ',
                rows[i].name.c_str(), p.fits ? "yes" : "no", SecondsOf(p, "compute").c_str(),
                SecondsOf(p, "device_to_host").c_str(), SecondsOf(p, "host_to_device").c_str(),
                SecondsOf(p, "nvme").c_str(), SecondsOf(p, "cpu_optimizer").c_str(),
                SecondsOf(p, "link").c_str(), step.c_str(), p.bound_by.c_str());
  }
  std::vector<std::string> unknown;
  for (const StepPrediction& p : predictions) {
    for (const std::string& u : p.unknown) {
      if (std::find(unknown.begin(), unknown.end(), u) == unknown.end()) unknown.push_back(u);
    }
  }
  if (!unknown.empty()) {
    std::string names;
    for (const std::string& u : unknown) names += (names.empty() ? "" : ", ") + u;
    std::printf(
        "\n  Not counted (no rate given; see --help or --measure): %s. Steps marked >= are lower "
        "bounds, chosen only when no placement with every rate known fits.\n",
        names.c_str());
  }
  if (chosen >= 0) {
    std::printf("\nChosen: %s: %.4f s per step, bound by %s.\n", rows[chosen].name.c_str(),
                predictions[chosen].step_seconds,
                predictions[chosen].bound_by.empty() ? "nothing measured"
                                                     : predictions[chosen].bound_by.c_str());
    if (const uint64_t in_host = MaxStatesInHost(rows[chosen]); in_host > 0) {
      std::printf("Run it with --max-states-in-host %s (placement.max_states_in_host).\n",
                  FormatBytes(in_host).c_str());
    }
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!predictions[i].fits) {
      std::printf("  %s does not fit: %s\n", rows[i].name.c_str(), predictions[i].why_not.c_str());
    }
  }
}

void PrintTable(const PlanInput& in, const std::vector<PlanRow>& rows) {
  std::printf(
      "Model state per GPU: %.4g parameters on %d GPUs, %s working copy, %s "
      "(%.0f optimizer bytes per parameter)\n\n",
      in.params, in.gpus, std::string(DTypeName(in.working_dtype)).c_str(),
      std::string(OptimizerTypeName(in.optimizer)).c_str(),
      offload::OptimizerBytesPerParam(in.optimizer, in.working_dtype));
  std::printf("  %-42s %8s %8s %8s %8s   %8s %8s   %s\n", "", "params", "grads", "optim", "GPU GB",
              "host GB", "nvme GB", "comm/step");
  for (const PlanRow& r : rows) {
    // In the paper's unit: Psi elements of the working dtype.
    const double psi_multiple = r.comm_bytes / DTypeSize(in.working_dtype) / in.params;
    std::printf("  %-42s %8s %8s %8s %8s   %8s %8s   %.3g Psi (%s GB)\n", r.name.c_str(),
                Gb(r.device.params).c_str(), Gb(r.device.grads).c_str(),
                Gb(r.device.optimizer_states).c_str(), Gb(r.device.total()).c_str(),
                Gb(r.host.total()).c_str(), Gb(r.nvme.total()).c_str(), psi_multiple,
                Gb(r.comm_bytes).c_str());
  }
  if (in.quantized_weights || in.quantized_gradients) {
    std::string what;
    if (in.quantized_weights) what = "parameters gathered as blockwise int8";
    if (in.quantized_gradients) {
      what += std::string(what.empty() ? "" : ", ") + "gradients reduced as blockwise int" +
              std::to_string(in.quantized_gradient_bits);
    }
    std::printf("\nZeRO++ on ZeRO-3's collectives: %s.\n", what.c_str());
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
                   "placements (the ZeRO paper's accounting); given the machine's memory and "
                   "rates, each placement's step time per resource and the fastest that fits.");
  flags.AddDouble("params", &params, "parameter count, e.g. 10e9 (required)");
  flags.AddInt("gpus", &gpus,
               "data-parallel GPUs (default 1, or the ranks under mpirun, srun or torchrun)");
  flags.AddString("precision", &precision, "DTYPE", "working dtype: fp16 (default), bf16, fp32");
  flags.AddString("optimizer", &optimizer, "NAME", "adamw (default), adam, adagrad or lion");
  flags.AddBool("json", &json, "print one JSON document instead of a table");
  bool quantized_weights = false, quantized_gradients = false;
  int64_t quantized_gradient_bits = EngineOptions().placement.quantized_gradient_bits;
  flags.AddBool("zero-quantized-weights", &quantized_weights,
                "ZeRO++: ZeRO-3 gathers parameters as blockwise int8 (as strata train's flag)");
  flags.AddBool("zero-quantized-gradients", &quantized_gradients,
                "ZeRO++: ZeRO-3 reduces gradients as blockwise integers (as strata train's flag)");
  flags.AddInt("zero-quantized-gradient-bits", &quantized_gradient_bits,
               "their width: 8 (default) or 4");
  MachineFlags machine;
  flags.AddBytes("device-memory", &machine.device_memory,
                 "GPU memory per GPU for model state; with any of these flags, step times per "
                 "placement and the fastest that fits are printed");
  flags.AddBytes("host-memory", &machine.host_memory, "host memory of the node");
  flags.AddBytes("nvme-bytes", &machine.nvme_bytes, "NVMe space of the node");
  flags.AddDouble("h2d-gbps", &machine.h2d_gbps, "host->device GB/s per GPU");
  flags.AddDouble("d2h-gbps", &machine.d2h_gbps, "device->host GB/s per GPU");
  flags.AddDouble("nvme-read-gbps", &machine.nvme_read_gbps,
                  "NVMe read GB/s of the node, as the engine reads chunks");
  flags.AddDouble("nvme-write-gbps", &machine.nvme_write_gbps, "NVMe write GB/s of the node");
  flags.AddDouble("optimizer-gparams", &machine.optimizer_gparams,
                  "CPU optimizer rate of the node, 1e9 params/s");
  flags.AddDouble("link-gbps", &machine.link_gbps, "GPU-GPU GB/s per GPU for the collectives");
  flags.AddDouble("compute-seconds", &machine.compute_seconds,
                  "forward + backward seconds per GPU per step");
  flags.AddDouble("tokens", &machine.tokens, "tokens per GPU per step (with --tflops)");
  flags.AddDouble("tflops", &machine.tflops, "achieved TFLOP/s per GPU (with --tokens)");
  flags.AddDouble("gradient-clipping", &machine.gradient_clipping,
                  "max global gradient norm, as DeepSpeed's gradient_clipping (0 = none): "
                  "updates need the global norm, as with fp16's overflow check");
  flags.AddBool("delayed-update", &machine.delayed_update,
                "predict with the delayed parameter update (optimizer.delayed_update): each "
                "step's update runs beside the next step's forward and backward");
  flags.AddBool("no-speculation", &machine.no_speculation,
                "with clipping or fp16, predict updates that wait for backward to end "
                "(optimizer.speculative_updates false)");
  flags.AddBool("measure", &machine.measure,
                "measure on this machine the rates not given (the engine's chunk copies, swap "
                "space and optimizer; under mpirun or srun with several ranks, the link too: "
                "the engine's reduce-scatters and all-gathers across the ranks, over MPI)");
  flags.AddString("nvme-path", &machine.nvme_path, "DIR",
                  "directory --measure times NVMe in (default $TMPDIR or /tmp)");
  flags.AddBytes("chunk-size", &machine.chunk_size,
                 "the engine's working bytes per chunk (default 64MiB): the chunks --measure "
                 "times, and how many chunks' NVMe states are read ahead of backward");
  if (const std::optional<int> done = ParseFlags(flags, args, command)) return *done;
  // Under a launcher with several ranks: --gpus defaults to them, --measure times the link with
  // collectives across them (MPI, as `strata train` runs them), and the first rank prints.
  const Result<offload::RankInfo> launched = offload::DetectRanks();
  if (!launched.ok()) return Fail(kExitUsage, launched.status().message(), command);
  const bool several = launched->size > 1;
  if (several && !flags.was_set("gpus")) gpus = launched->size;
  std::unique_ptr<offload::Communicator> ranks;
  if (several && machine.measure && !(machine.link_gbps > 0)) {
    auto created = ConnectLaunchedRanks(*launched, {});
    if (!created.ok()) {
      return Fail(kExitFailure, "measuring the link across " + std::to_string(launched->size) +
                                    " ranks: " + created.status().message() +
                                    "; or give --link-gbps");
    }
    ranks = std::move(*created);
  }
  const bool prints = launched->rank == 0;
  PlanInput input{.params = params, .gpus = int(std::clamp<int64_t>(gpus, 0, 1 << 24))};
  auto dtype = ParseDType(precision);
  if (!dtype.ok()) return Fail(kExitUsage, dtype.status().message(), command);
  auto type = ParseOptimizerType(optimizer);
  if (!type.ok()) return Fail(kExitUsage, type.status().message(), command);
  input.working_dtype = *dtype;
  input.optimizer = *type;
  input.gradient_clipping = machine.gradient_clipping;
  input.speculative_updates = !machine.no_speculation;
  input.delayed_update = machine.delayed_update;
  input.quantized_weights = quantized_weights;
  input.quantized_gradients = quantized_gradients;
  input.quantized_gradient_bits = int(std::clamp<int64_t>(
      quantized_gradient_bits, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
  if (machine.chunk_size > 0) input.chunk_bytes = machine.chunk_size;
  if (Status s = input.Validate(); !s.ok()) return Fail(kExitUsage, s.message(), command);
  if (Status s = ValidateMachine(machine); !s.ok()) return Fail(kExitUsage, s.message(), command);
  std::vector<PlanRow> rows = offload::PlanMemory(input);
  if (machine.host_memory > 0) {
    // With the machine's host memory known: each NVMe placement also split, as much of its
    // states in host memory as fits (placement.max_states_in_host), right after it.
    for (size_t i = 0; i < rows.size(); ++i) {
      if (auto split = offload::SplitStatesAcrossHostAndNvme(rows[i], input.gpus,
                                                             double(machine.host_memory))) {
        rows.insert(rows.begin() + long(++i), *split);
      }
    }
  }
  if (!machine.given()) {
    if (!prints) return kExitOk;
    if (json) {
      std::cout << ToJson(input, rows).dump(2) << "\n";
    } else {
      PrintTable(input, rows);
    }
    return kExitOk;
  }

  auto rates = RatesFor(machine, input, prints, ranks.get());
  if (!rates.ok()) return Fail(kExitFailure, "measuring: " + rates.status().message());
  if (!prints) return kExitOk;
  const MachineMemory memory{.device_bytes = double(machine.device_memory),
                             .host_bytes = double(machine.host_memory),
                             .nvme_bytes = double(machine.nvme_bytes)};
  std::vector<StepPrediction> predictions;
  for (const PlanRow& row : rows) {
    predictions.push_back(offload::PredictStep(input, row, *rates, memory));
  }
  const int chosen = offload::ChoosePlacement(predictions);
  if (json) {
    nlohmann::ordered_json j = ToJson(input, rows);
    AddPredictions(j, *rates, memory, rows, predictions, chosen);
    std::cout << j.dump(2) << "\n";
  } else {
    PrintTable(input, rows);
    PrintPredictions(*rates, memory, rows, predictions, chosen);
  }
  if (chosen < 0) {
    return Fail(kExitFailure, "no placement fits this machine's memory (see the table)");
  }
  return kExitOk;
}

}  // namespace strata::tools
