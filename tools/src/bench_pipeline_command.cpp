// `strata bench pipeline`: a synthetic model's training step through the offload engine against
// each resource timed alone (PERFORMANCE.md: step <= 1.10 x the slowest with states on host,
// <= 1.15 on NVMe), as a table or as JSON.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_json.h"
#include "commands.h"
#include "flags.h"
#include "strata/core/bytes.h"
#include "strata/offload/pipeline_benchmark.h"

namespace strata::tools {
namespace {

using offload::PipelineBenchmarkOptions;
using offload::PipelineBenchmarkResult;

void PrintTable(const PipelineBenchmarkOptions& o, const PipelineBenchmarkResult& r) {
  std::printf(
      "%d chunks x %s of %s working params (%s params); forward %.1f ms + backward %.1f ms per "
      "chunk; copies %.1f GB/s; optimizer states on %s\n\n",
      o.chunks, FormatBytes(o.chunk_bytes).c_str(), std::string(DTypeName(o.working_dtype)).c_str(),
      FormatCount(r.params).c_str(), o.forward_ms, o.backward_ms, o.copy_gbps,
      std::string(TierName(o.optimizer_states)).c_str());
  if (o.params != Tier::kDevice) {
    std::printf("working parameters on %s: the device holds a few chunks at a time\n\n",
                std::string(TierName(o.params)).c_str());
  }
  if (o.max_states_in_host > 0) {
    std::printf("(up to %s of the states in host memory instead)\n\n",
                FormatBytes(o.max_states_in_host).c_str());
  }
  if (o.delayed_update) {
    std::printf("delayed parameter update: each step's update runs beside the next step\n\n");
  }
  if (o.gradient_clipping > 0) {
    std::printf("gradient clipping at %g, %s; speculative updates %s\n\n", o.gradient_clipping,
                o.clip_triggered
                    ? "twice that norm in the last chunk to land: every step clips at its end"
                    : "zero gradients: no step clips",
                o.speculative_updates ? "on" : "off");
  }
  std::printf("  %-26s %12s %12s %12s\n", "alone", "seconds", "bytes", "GB/s");
  for (const auto& resource : r.resources) {
    if (resource.bytes > 0) {
      std::printf("  %-26s %12.4f %12s %12.2f\n", resource.name.c_str(), resource.seconds,
                  FormatBytes(resource.bytes).c_str(), resource.bytes / resource.seconds / 1e9);
    } else {
      std::printf("  %-26s %12.4f\n", resource.name.c_str(), resource.seconds);
    }
  }
  if (r.nvme_after_seconds > 0) {
    std::printf("\n  (nvme alone: %.4f s before the engine steps, %.4f s after; the mean above)",
                r.nvme_before_seconds, r.nvme_after_seconds);
  }
  std::printf("\n  %-26s %12.4f  (%s)\n", "slowest resource", r.slowest_seconds, r.slowest.c_str());
  std::printf("  %-26s %12.4f\n", "serial sum (no overlap)", r.serial_seconds);
  std::printf("  %-26s %12.4f  (median of %zu)\n", "engine step", r.step_median_seconds,
              r.step_seconds.size());
  const bool nvme_used =
      std::any_of(r.resources.begin(), r.resources.end(),
                  [](const auto& resource) { return resource.name == "nvme_read"; });
  std::printf("  %-26s %12.3f  (target <= %.2f)\n", "step / slowest", r.ratio_to_slowest,
              nvme_used ? 1.15 : 1.10);
  std::printf("  %-26s %12.3f\n", "step / serial sum", r.ratio_to_serial);
  std::printf("  %-26s %12s  (peak of %s budget)\n", "engine host memory",
              FormatBytes(r.host_peak_bytes).c_str(), FormatBytes(r.host_budget_bytes).c_str());
  std::printf("  %-26s %12s  (of %s physical)\n", "process peak resident",
              FormatBytes(r.peak_rss_bytes).c_str(), FormatBytes(r.physical_memory_bytes).c_str());
  if (o.gradient_clipping > 0 || o.working_dtype == DType::kFp16) {
    std::printf("  %-26s %12d  (of %zu; updates made ahead of the verdict, redone)\n",
                "rolled-back steps", r.rolled_back_steps, r.step_seconds.size());
  }
}

}  // namespace

nlohmann::ordered_json ToJson(const PipelineBenchmarkOptions& o, const PipelineBenchmarkResult& r) {
  nlohmann::ordered_json j;
  j["chunks"] = o.chunks;
  j["chunk_bytes"] = o.chunk_bytes;
  j["params"] = r.params;
  j["precision"] = DTypeName(o.working_dtype);
  j["offload_optimizer"] = TierName(o.optimizer_states);
  j["offload_param"] = TierName(o.params);
  j["max_states_in_host"] = o.max_states_in_host;
  j["state_buffers"] = o.state_buffers;
  j["forward_ms"] = o.forward_ms;
  j["backward_ms"] = o.backward_ms;
  j["copy_gbps"] = o.copy_gbps;
  j["gradient_clipping"] = o.gradient_clipping;
  j["clip_triggered"] = o.clip_triggered;
  j["speculative_updates"] = o.speculative_updates;
  j["delayed_update"] = o.delayed_update;
  nlohmann::ordered_json resources = nlohmann::ordered_json::object();
  for (const auto& resource : r.resources) {
    resources[resource.name] = {{"seconds", resource.seconds}, {"bytes", resource.bytes}};
  }
  j["resources"] = resources;
  j["slowest"] = r.slowest;
  j["slowest_seconds"] = r.slowest_seconds;
  j["serial_seconds"] = r.serial_seconds;
  j["step_seconds"] = r.step_seconds;
  j["step_median_seconds"] = r.step_median_seconds;
  j["ratio_to_slowest"] = r.ratio_to_slowest;
  j["ratio_to_serial"] = r.ratio_to_serial;
  j["rolled_back_steps"] = r.rolled_back_steps;
  j["nvme_before_seconds"] = r.nvme_before_seconds;
  j["nvme_after_seconds"] = r.nvme_after_seconds;
  j["host_budget_bytes"] = r.host_budget_bytes;
  j["host_peak_bytes"] = r.host_peak_bytes;
  j["peak_rss_bytes"] = r.peak_rss_bytes;
  j["physical_memory_bytes"] = r.physical_memory_bytes;
  return j;
}

int RunBenchPipeline(const std::vector<std::string>& args) {
  const std::string command = "strata bench pipeline";
  PipelineBenchmarkOptions o;
  std::string precision = "bf16", offload_optimizer = "host", offload_param = "device", nvme_path;
  int64_t chunks = o.chunks, threads = 0, state_buffers = 0, warmup = o.warmup_steps,
          steps = o.timed_steps;
  bool json = false, no_speculation = false;
  FlagParser flags(command,
                   "Time a synthetic model's training step through the offload engine on "
                   "HostDevice against each resource alone (compute, copies, CPU Adam, NVMe).");
  flags.AddInt("chunks", &chunks, "chunks of the synthetic model (default 16)");
  flags.AddBytes("chunk-size", &o.chunk_bytes, "working parameters per chunk (default 8MiB)");
  flags.AddString("precision", &precision, "DTYPE", "working dtype: bf16 (default), fp16, fp32");
  flags.AddDouble("forward-ms", &o.forward_ms, "device compute per chunk forward (default 5)");
  flags.AddDouble("backward-ms", &o.backward_ms, "device compute per chunk backward (default 10)");
  flags.AddDouble("copy-gbps", &o.copy_gbps,
                  "host<->device bandwidth per direction, GB/s; 0 = memcpy (default 4)");
  flags.AddString("offload-optimizer", &offload_optimizer, "TIER",
                  "where optimizer states live: host (default) or nvme");
  flags.AddString("offload-param", &offload_param, "TIER",
                  "where working parameters live: device (default) or host; with host the "
                  "device holds a few chunks and forward and backward fetch them");
  flags.AddString("nvme-path", &nvme_path, "DIR", "directory for NVMe swap (with nvme)");
  flags.AddBytes("max-states-in-host", &o.max_states_in_host,
                 "with nvme: this much of the states (the first chunks) in host memory instead");
  flags.AddInt("state-buffers", &state_buffers,
               "with nvme: staging buffers for the states (host.optimizer_buffer_count); "
               "0 (default) = automatic");
  flags.AddDouble("gradient-clipping", &o.gradient_clipping,
                  "clip to this global gradient norm (default 0 = off); the synthetic "
                  "gradients are zero, so no step clips unless --clip-triggered");
  flags.AddBool("delayed-update", &o.delayed_update,
                "delayed parameter update from the first step: each step's update runs beside "
                "the next step's forward and backward");
  flags.AddBool("clip-triggered", &o.clip_triggered,
                "the last chunk backward reaches gets gradients of twice the "
                "--gradient-clipping norm (default 1.0): every step clips once they land and "
                "redoes the updates made ahead (the worst case)");
  flags.AddBool("no-speculation", &no_speculation,
                "clipped and fp16 steps wait for the global norm (speculative_updates false)");
  flags.AddInt("threads", &threads, "CPU optimizer threads; 0 (default) = all");
  flags.AddInt("warmup", &warmup, "untimed engine steps first (default 2)");
  flags.AddInt("steps", &steps, "timed engine steps; the median is reported (default 5)");
  flags.AddBool("json", &json, "print one JSON document instead of a table");
  if (const std::optional<int> done = ParseFlags(flags, args, command)) return *done;
  auto dtype = ParseDType(precision);
  if (!dtype.ok()) return Fail(kExitUsage, dtype.status().message(), command);
  auto tier = ParseTier(offload_optimizer);
  if (!tier.ok()) return Fail(kExitUsage, tier.status().message(), command);
  o.working_dtype = *dtype;
  o.speculative_updates = !no_speculation;
  if (o.clip_triggered && o.gradient_clipping == 0) o.gradient_clipping = 1.0;
  o.optimizer_states = *tier;
  auto param_tier = ParseTier(offload_param);
  if (!param_tier.ok()) return Fail(kExitUsage, param_tier.status().message(), command);
  o.params = *param_tier;
  if (!nvme_path.empty()) o.nvme_paths = {nvme_path};
  o.chunks = static_cast<int>(std::clamp<int64_t>(chunks, -1, 1 << 30));
  o.threads = static_cast<int>(std::clamp<int64_t>(threads, 0, 4096));
  o.state_buffers = static_cast<int>(std::clamp<int64_t>(state_buffers, -1, 1 << 20));
  o.warmup_steps = static_cast<int>(std::clamp<int64_t>(warmup, -1, 1000));
  o.timed_steps = static_cast<int>(std::clamp<int64_t>(steps, 0, 1000));
  if (Status s = o.Validate(); !s.ok()) return Fail(kExitUsage, s.message(), command);
  o.progress = [](const std::string& line) { std::fprintf(stderr, "\r  %-40s", line.c_str()); };

  auto result = offload::RunPipelineBenchmark(o);
  std::fprintf(stderr, "\r%50s\r", "");
  if (!result.ok()) return Fail(kExitFailure, result.status().message());
  if (json) {
    std::cout << ToJson(o, *result).dump(2) << "\n";
  } else {
    PrintTable(o, *result);
  }
  return kExitOk;
}

}  // namespace strata::tools
