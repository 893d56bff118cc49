// `strata bench adam`: the CPU optimizer step against its memory-bandwidth roofline, measured in
// the same run (PERFORMANCE.md), as a table or as JSON.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench_json.h"
#include "commands.h"
#include "flags.h"
#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/options.h"
#include "strata/cpu_adam/adam_benchmark.h"

namespace strata::tools {
namespace {

using cpu_adam::AdamBenchmarkOptions;
using cpu_adam::AdamBenchmarkResult;

/// The command line as benchmark options. Usage errors are InvalidArgument.
Result<AdamBenchmarkOptions> ToOptions(const std::string& optimizer, uint64_t numel,
                                       const std::string& grad_dtype,
                                       const std::string& state_dtype,
                                       const std::string& param_copy, int64_t threads,
                                       const std::string& simd, int64_t warmup, int64_t runs) {
  AdamBenchmarkOptions options;
  STRATA_ASSIGN_OR_RETURN(options.optimizer, ParseOptimizerType(optimizer));
  options.numel = numel;
  STRATA_ASSIGN_OR_RETURN(options.grad_dtype, ParseDType(grad_dtype));
  STRATA_ASSIGN_OR_RETURN(options.state_dtype, ParseDType(state_dtype));
  if (param_copy != "none") {
    STRATA_ASSIGN_OR_RETURN(options.param_copy_dtype, ParseDType(param_copy));
  }
  if (threads < 0 || threads > 4096) {
    return InvalidArgument("--threads must be between 0 (all) and 4096, got " +
                           std::to_string(threads));
  }
  options.threads = static_cast<int>(threads);
  if (simd != "auto") {
    STRATA_ASSIGN_OR_RETURN(options.simd, cpu_adam::ParseSimdLevel(simd));
  }
  if (warmup < 0 || warmup > 1000 || runs < 1 || runs > 1000) {
    return InvalidArgument("--warmup must be in [0, 1000] and --runs in [1, 1000]");
  }
  options.warmup_runs = static_cast<int>(warmup);
  options.timed_runs = static_cast<int>(runs);
  STRATA_RETURN_IF_ERROR(options.Validate());
  return options;
}

std::string CopyName(const AdamBenchmarkOptions& options) {
  return options.param_copy_dtype ? std::string(DTypeName(*options.param_copy_dtype)) : "none";
}

void PrintTable(const AdamBenchmarkOptions& options, const AdamBenchmarkResult& r) {
  std::printf("%s step over %zu params (%s): grads %s, states %s, param copy %s; %s, %d threads\n",
              std::string(OptimizerTypeName(options.optimizer)).c_str(), r.numel,
              FormatCount(r.numel).c_str(), std::string(DTypeName(options.grad_dtype)).c_str(),
              std::string(DTypeName(options.state_dtype)).c_str(), CopyName(options).c_str(),
              std::string(cpu_adam::SimdLevelName(r.simd_level)).c_str(), r.threads);
  std::printf("%zu bytes per param; median of %d runs after %d warm-up\n\n", r.bytes_per_param,
              options.timed_runs, options.warmup_runs);
  std::printf("  %-22s %14s %12s %12s\n", "", "params/s", "GB/s", "median s");
  std::printf("  %-22s %14.4g %12.2f %12.4f\n", "step", r.params_per_second,
              r.bytes_per_second / 1e9, r.step_median_seconds);
  const std::string roofline =
      "roofline (" + std::string(cpu_adam::SimdLevelName(r.roofline_simd_level)) + ")";
  std::printf("  %-22s %14.4g %12.2f %12.4f\n", roofline.c_str(), r.roofline_params_per_second,
              r.roofline_bytes_per_second / 1e9, r.roofline_median_seconds);
  std::printf("  %-22s %14.3f\n", "ratio", r.ratio);
}

}  // namespace

nlohmann::ordered_json ToJson(const AdamBenchmarkOptions& options, const AdamBenchmarkResult& r) {
  nlohmann::ordered_json j;
  j["optimizer"] = OptimizerTypeName(options.optimizer);
  j["numel"] = r.numel;
  j["grad_dtype"] = DTypeName(options.grad_dtype);
  j["state_dtype"] = DTypeName(options.state_dtype);
  j["param_copy"] = CopyName(options);
  j["simd"] = cpu_adam::SimdLevelName(r.simd_level);
  j["roofline_simd"] = cpu_adam::SimdLevelName(r.roofline_simd_level);
  j["threads"] = r.threads;
  j["bytes_per_param"] = r.bytes_per_param;
  j["warmup_runs"] = options.warmup_runs;
  j["timed_runs"] = options.timed_runs;
  j["step_median_seconds"] = r.step_median_seconds;
  j["roofline_median_seconds"] = r.roofline_median_seconds;
  j["params_per_second"] = r.params_per_second;
  j["bytes_per_second"] = r.bytes_per_second;
  j["roofline_params_per_second"] = r.roofline_params_per_second;
  j["roofline_bytes_per_second"] = r.roofline_bytes_per_second;
  j["ratio"] = r.ratio;
  j["step_seconds"] = r.step_seconds;
  j["roofline_seconds"] = r.roofline_seconds;
  return j;
}

int RunBenchAdam(const std::vector<std::string>& args) {
  const std::string command = "strata bench adam";
  std::string optimizer = "adamw", grad_dtype = "fp32", state_dtype = "fp32";
  std::string param_copy = "none", simd = "auto";
  uint64_t numel = 256 * kMiB;
  int64_t threads = 0, warmup = 1, runs = 5;
  bool json = false;
  FlagParser flags(command,
                   "Time one CPU optimizer step over large arrays against a trivial kernel that "
                   "moves the same bytes (the memory-bandwidth roofline), in the same run.");
  flags.AddString("optimizer", &optimizer, "NAME", "adamw (default), adam, adagrad or lion");
  flags.AddBytes("numel", &numel, "parameters per step, e.g. 256Mi (default) or 1e9");
  flags.AddString("grad-dtype", &grad_dtype, "DTYPE", "fp32 (default), fp16 or bf16");
  flags.AddString("state-dtype", &state_dtype, "DTYPE", "fp32 (default) or bf16");
  flags.AddString("param-copy", &param_copy, "DTYPE",
                  "none (default), fp16 or bf16: also write the updated params in this dtype");
  flags.AddInt("threads", &threads, "threads; 0 (default) = all");
  flags.AddString("simd", &simd, "LEVEL",
                  "auto (default: STRATA_SIMD or the best this CPU runs), scalar, avx2, avx512");
  flags.AddInt("warmup", &warmup, "untimed runs first (default 1)");
  flags.AddInt("runs", &runs, "timed runs; the median is reported (default 5)");
  flags.AddBool("json", &json, "print one JSON document instead of a table");
  if (const std::optional<int> done = ParseFlags(flags, args, command)) return *done;
  auto options =
      ToOptions(optimizer, numel, grad_dtype, state_dtype, param_copy, threads, simd, warmup, runs);
  if (!options.ok()) return Fail(kExitUsage, options.status().message(), command);

  auto result = cpu_adam::RunAdamBenchmark(*options);
  if (!result.ok()) return Fail(kExitFailure, result.status().message());
  if (json) {
    std::cout << ToJson(*options, *result).dump(2) << "\n";
  } else {
    PrintTable(*options, *result);
  }
  return kExitOk;
}

}  // namespace strata::tools
