// `strata bench all`: every tier benchmark this machine supports, one after the other with a
// progress line each, then one summary table; with --out, bench.json and a CSV per benchmark
// for scripts/plot_bench.py.
//
// 1. adam:     the CPU optimizer against its memory-bandwidth roofline (fp32 grads, and bf16
//              grads writing a bf16 copy as the engine does), on one thread and on all.
// 2. nvme:     sequential O_DIRECT read and write bandwidth over block sizes and queue depths.
// 3. copies:   host<->device bandwidth per transfer size (copy_bench.h says which device).
// 4. pipeline: an engine step against its slowest resource, states on host and on NVMe.
//
// A benchmark that fails (an --nvme-path where O_DIRECT or the space is missing, no device)
// says why and the others still run: the summary and --out hold what was measured, with the
// failures under "errors", and the exit status is 1.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_json.h"
#include "commands.h"
#include "copy_bench.h"
#include "flags.h"
#include "nvme_bench.h"
#include "strata/core/bytes.h"
#include "strata/core/input_file.h"
#include "system_info.h"

namespace strata::tools {
namespace {

using nlohmann::ordered_json;
constexpr const char* kCommand = "strata bench all";
constexpr int kSteps = 4;

struct BenchAllFlags {
  std::string out, nvme_path;
  bool quick = false;
  bool json = false;
};

/// "[2/4] nvme: ..." on stderr: where a long run is.
void Progress(int step, const std::string& line) {
  std::fprintf(stderr, "[%d/%d] %s\n", step, kSteps, line.c_str());
}

Status RunAdam(const BenchAllFlags& f, ordered_json& report) {
  const size_t numel = f.quick ? 16 * kMiB : 64 * kMiB;
  Progress(1, "adam: CPU optimizer step vs its memory-bandwidth roofline, " + FormatCount(numel) +
                  " params, 4 settings");
  const int all_threads = std::max(1, report["machine"]["hardware_threads"].get<int>());
  for (bool engine_dtypes : {false, true}) {
    for (int threads : {1, all_threads}) {
      cpu_adam::AdamBenchmarkOptions o;
      o.numel = numel;
      o.threads = threads;
      o.timed_runs = f.quick ? 3 : 5;
      if (engine_dtypes) {
        o.grad_dtype = DType::kBf16;
        o.param_copy_dtype = DType::kBf16;
      }
      STRATA_ASSIGN_OR_RETURN(cpu_adam::AdamBenchmarkResult r, cpu_adam::RunAdamBenchmark(o));
      std::fprintf(stderr, "      %s grads%s, %d thread%s: %.3g params/s, %s, %.2f of roofline\n",
                   engine_dtypes ? "bf16" : "fp32", engine_dtypes ? " + bf16 copy" : "", threads,
                   threads == 1 ? "" : "s", r.params_per_second,
                   FormatBandwidth(r.bytes_per_second).c_str(), r.ratio);
      report["adam"].push_back(ToJson(o, r));
      if (all_threads == 1) break;
    }
  }
  return Status();
}

Status RunNvme(const BenchAllFlags& f, ordered_json& report) {
  NvmeBenchSettings s;
  s.path = f.nvme_path;
  // One file for every setting: laid out once, then overwritten and read by each; created
  // here, so removed after (a file of that name that was there already is not ours: refused).
  s.file = f.nvme_path + "/strata-bench-all-" + std::to_string(getpid()) + ".bin";
  if (std::error_code ec;
      std::filesystem::symlink_status(s.file, ec).type() != std::filesystem::file_type::not_found) {
    return FailedPrecondition("measuring NVMe: " + s.file +
                              " exists and this run did not create it; move it away");
  }
  s.size = f.quick ? 256 * kMiB : kGiB;
  s.progress = false;
  Progress(2, "nvme: sequential O_DIRECT read and write in " + f.nvme_path + ", " +
                  FormatBytes(s.size) + " per pass, 3 block sizes x 2 queue depths");
  Status status;
  for (uint64_t block : {128 * kKiB, 1 * kMiB, 8 * kMiB}) {
    for (uint32_t depth : {8u, 32u}) {
      s.block_size = block;
      s.queue_depth = depth;
      Result<std::vector<NvmePass>> passes = RunNvmeBench(s, "both");
      if (!passes.ok()) {
        status = passes.status();
        break;
      }
      for (const NvmePass& p : *passes) {
        std::fprintf(stderr, "      %-5s %6s x qd%-3u %s\n", nvme::IoOpName(p.op),
                     FormatBytes(block).c_str(), depth,
                     FormatBandwidth(p.bytes_per_second()).c_str());
        report["nvme"].push_back(ToJson(p));
      }
    }
    if (!status.ok()) break;
  }
  std::error_code ignored;
  std::filesystem::remove(s.file, ignored);
  return status.WithContext("measuring NVMe in " + f.nvme_path);
}

Status RunCopies(const BenchAllFlags& f, ordered_json& report) {
  CopyBenchSettings s;
  if (f.quick) s.bytes_per_size = 128 * kMiB;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, OpenTrainingDevice(256 * kMiB));
  const std::string name = device->properties().name;
  Progress(3, "copies: host <-> device per transfer size on " + name);
  report["machine"]["device"] = name;
  STRATA_ASSIGN_OR_RETURN(std::vector<CopyPoint> points, RunCopyBench(*device, s));
  for (const CopyPoint& p : points) {
    if (p.bytes == s.sizes.back()) {
      std::fprintf(stderr, "      %-15s %6s copies: %s\n", p.direction.c_str(),
                   FormatBytes(p.bytes).c_str(), FormatBandwidth(p.bytes_per_second()).c_str());
    }
    report["copies"].push_back(ToJson(p));
  }
  return Status();
}

Status RunPipelines(const BenchAllFlags& f, ordered_json& report) {
  Progress(4, "pipeline: an engine step vs its slowest resource, states on host and on nvme");
  for (Tier states : {Tier::kHost, Tier::kNvme}) {
    offload::PipelineBenchmarkOptions o;
    o.optimizer_states = states;
    if (states == Tier::kNvme) o.nvme_paths = {f.nvme_path};
    if (f.quick) {
      o.chunks = 8;
      o.chunk_bytes = 4 * kMiB;
      o.warmup_steps = 1;
      o.timed_steps = 3;
    }
    Result<offload::PipelineBenchmarkResult> result = offload::RunPipelineBenchmark(o);
    if (!result.ok()) {
      return result.status().WithContext("states on " + std::string(TierName(states)));
    }
    const offload::PipelineBenchmarkResult& r = *result;
    std::fprintf(stderr, "      states on %-4s step %.4f s = %.3f x slowest (%s), %.3f x serial\n",
                 std::string(TierName(states)).c_str(), r.step_median_seconds, r.ratio_to_slowest,
                 r.slowest.c_str(), r.ratio_to_serial);
    report["pipeline"].push_back(ToJson(o, r));
  }
  return Status();
}

/// The headline figure per tier pair: the best bandwidth measured for it.
ordered_json TierSummary(const ordered_json& report) {
  ordered_json tiers = ordered_json::array();
  auto best = [&](const char* key, const std::string& field, const std::string& value,
                  const char* from, const char* to) {
    if (!report.contains(key)) return;
    const ordered_json* top = nullptr;
    for (const ordered_json& entry : report.at(key)) {
      if (entry.at(field) != value) continue;
      if (top == nullptr || entry.at("bytes_per_second") > top->at("bytes_per_second")) {
        top = &entry;
      }
    }
    if (top == nullptr) return;
    const bool nvme = top->contains("queue_depth");  // Else a copy of "bytes".
    const std::string setting = nvme
                                    ? FormatBytes(top->at("block_size").get<uint64_t>()) + " x qd" +
                                          std::to_string(top->at("queue_depth").get<int>())
                                    : FormatBytes(top->at("bytes").get<uint64_t>()) + " copies";
    tiers.push_back({{"from", from},
                     {"to", to},
                     {"bytes_per_second", top->at("bytes_per_second")},
                     {"setting", setting}});
  };
  best("copies", "direction", "host_to_device", "host", "device");
  best("copies", "direction", "device_to_host", "device", "host");
  best("nvme", "rw", "read", "nvme", "host");
  best("nvme", "rw", "write", "host", "nvme");
  return tiers;
}

void PrintSummary(const ordered_json& report) {
  const ordered_json& machine = report["machine"];
  std::printf("\nTiers of %s (%d hardware threads, %s; device: %s)\n",
              machine["cpu"].get<std::string>().c_str(), machine["hardware_threads"].get<int>(),
              machine["simd"].get<std::string>().c_str(),
              machine.value("device", std::string("not measured")).c_str());
  for (const ordered_json& t : report["tiers"]) {
    const std::string pair = t["from"].get<std::string>() + " -> " + t["to"].get<std::string>();
    std::printf("  %-30s %12s   %s\n", pair.c_str(),
                FormatBandwidth(t["bytes_per_second"].get<double>()).c_str(),
                t["setting"].get<std::string>().c_str());
  }
  for (const ordered_json& a : report.value("adam", ordered_json::array())) {
    const std::string name = "cpu adam, " + a["grad_dtype"].get<std::string>() + " grads, " +
                             std::to_string(a["threads"].get<int>()) + " thr";
    std::printf("  %-30s %12s   %.3g params/s, %.2f of its roofline\n", name.c_str(),
                FormatBandwidth(a["bytes_per_second"].get<double>()).c_str(),
                a["params_per_second"].get<double>(), a["ratio"].get<double>());
  }
  for (const ordered_json& p : report.value("pipeline", ordered_json::array())) {
    const std::string name = "pipeline, states on " + p["offload_optimizer"].get<std::string>();
    std::printf("  %-30s %10.4f s   step = %.3f x slowest resource (%s), %.3f x serial\n",
                name.c_str(), p["step_median_seconds"].get<double>(),
                p["ratio_to_slowest"].get<double>(), p["slowest"].get<std::string>().c_str(),
                p["ratio_to_serial"].get<double>());
  }
  if (!report.contains("errors")) return;
  for (const auto& [name, message] : report.at("errors").items()) {
    std::printf("  %-30s not measured: %s\n", name.c_str(), message.get<std::string>().c_str());
  }
}

/// A CSV field (RFC 4180): quoted when it holds a comma, a quote or a line break.
std::string CsvField(const ordered_json& value) {
  const std::string text = value.is_string() ? value.get<std::string>() : value.dump();
  if (text.find_first_of(",\"\n\r") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char c : text) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
  return quoted + "\"";
}

/// The header line of a CSV of `columns`.
std::string CsvHeader(const std::vector<std::string>& columns) {
  std::string header;
  for (size_t c = 0; c < columns.size(); ++c) header += (c ? "," : "") + columns[c];
  return header;
}

/// One CSV: a header of `columns`, then a row per entry (nested values as JSON text).
Status WriteCsv(const std::filesystem::path& file, const ordered_json& entries,
                const std::vector<std::string>& columns) {
  std::ofstream out(file);
  out << CsvHeader(columns) << "\n";
  for (const ordered_json& e : entries) {
    for (size_t c = 0; c < columns.size(); ++c) {
      const ordered_json& v = e.contains(columns[c]) ? e[columns[c]] : ordered_json();
      out << (c ? "," : "") << CsvField(v);
    }
    out << "\n";
  }
  out.close();
  if (!out) return IoError("writing " + file.string());
  return Status();
}

/// One CSV that --out holds: its file, the report's member whose entries are its rows, and its
/// columns (its header line).
struct CsvOutput {
  const char* file;
  const char* rows;
  std::vector<std::string> columns;
};

const std::vector<CsvOutput>& CsvOutputs() {
  static const std::vector<CsvOutput> outputs = {
      {"tiers.csv", "tiers", {"from", "to", "bytes_per_second", "setting"}},
      {"adam.csv",
       "adam",
       {"optimizer", "numel", "grad_dtype", "param_copy", "simd", "threads", "bytes_per_param",
        "params_per_second", "bytes_per_second", "roofline_params_per_second",
        "roofline_bytes_per_second", "ratio"}},
      {"nvme.csv",
       "nvme",
       {"rw", "block_size", "queue_depth", "bytes", "seconds", "bytes_per_second", "backend"}},
      {"copies.csv", "copies", {"direction", "bytes", "copies", "seconds", "bytes_per_second"}},
      {"pipeline.csv",
       "pipeline",
       {"offload_optimizer", "params", "slowest", "slowest_seconds", "serial_seconds",
        "step_median_seconds", "ratio_to_slowest", "ratio_to_serial"}}};
  return outputs;
}

/// An earlier run's output, read back to tell whether it is one.
constexpr InputKind kBenchOutput{"bench all output", uint64_t{64} << 20};

/// Whether what is at `path` may be overwritten: nothing, or a regular file this command wrote
/// (`written` says, from its content). FailedPrecondition otherwise, naming it.
Status CheckOverwritable(const std::filesystem::path& path,
                         const std::function<bool(const std::string&)>& written) {
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::symlink_status(path, ec);
  if (status.type() == std::filesystem::file_type::not_found) return Status();
  Result<std::string> text = status.type() == std::filesystem::file_type::regular
                                 ? ReadInputFile(path.string(), kBenchOutput)
                                 : Result<std::string>(InvalidArgument("not a regular file"));
  if (text.ok() && written(*text)) return Status();
  return FailedPrecondition("--out: " + path.string() +
                            " exists and was not written by strata bench all, so it is not "
                            "Strata's to overwrite; give --out a new or empty folder, or move "
                            "that file away");
}

/// Makes --out `dir` and checks, before minutes of measuring, that every file the run writes
/// there is absent or one an earlier run wrote.
Status MakeOutDir(const std::filesystem::path& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return IoError("creating " + dir.string() + ": " + error.message());
  STRATA_RETURN_IF_ERROR(CheckOverwritable(dir / "bench.json", [](const std::string& text) {
    const ordered_json json = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
    return json.is_object() && json.contains("version") && json.contains("machine") &&
           json.contains("tiers");
  }));
  for (const CsvOutput& csv : CsvOutputs()) {
    const std::string header = CsvHeader(csv.columns);
    STRATA_RETURN_IF_ERROR(CheckOverwritable(dir / csv.file, [&](const std::string& text) {
      return text.substr(0, text.find('\n')) == header;
    }));
  }
  return Status();
}

Status WriteOut(const std::filesystem::path& dir, const ordered_json& report) {
  {
    std::ofstream json(dir / "bench.json");
    json << report.dump(2) << "\n";
    json.close();
    if (!json) return IoError("writing " + (dir / "bench.json").string());
  }
  for (const CsvOutput& csv : CsvOutputs()) {
    STRATA_RETURN_IF_ERROR(
        WriteCsv(dir / csv.file, report.value(csv.rows, ordered_json::array()), csv.columns));
  }
  return Status();
}

}  // namespace

int RunBenchAll(const std::vector<std::string>& args) {
  BenchAllFlags f;
  FlagParser flags(kCommand,
                   "Run every tier benchmark this machine supports (CPU Adam, NVMe, host<->device "
                   "copies, the engine pipeline) and print one summary; --out writes JSON and CSV "
                   "for scripts/plot_bench.py.");
  flags.AddString("out", &f.out, "DIR", "write bench.json and one CSV per benchmark here");
  flags.AddString("nvme-path", &f.nvme_path, "DIR",
                  "directory on the NVMe drive to measure (default $TMPDIR or /tmp)");
  flags.AddBool("quick", &f.quick, "smaller sizes and fewer runs (about a minute)");
  flags.AddBool("json", &f.json, "print bench.json on stdout instead of the summary");
  if (const std::optional<int> done = ParseFlags(flags, args, kCommand)) return *done;
  if (f.nvme_path.empty()) f.nvme_path = TempDirectory();
  if (!std::filesystem::is_directory(f.nvme_path)) {
    return Fail(kExitUsage, "--nvme-path " + f.nvme_path + " is not a directory", kCommand);
  }

  // A bad --out fails now, not after minutes of measuring.
  if (!f.out.empty()) {
    if (Status s = MakeOutDir(f.out); !s.ok()) return Fail(kExitFailure, s.message());
  }

  const CpuInfo cpu = ProbeCpu();
  ordered_json report;
  report["version"] = 1;
  report["machine"] = {
      {"cpu", cpu.model},
      {"hardware_threads", cpu.logical_cpus},
      {"simd", std::string(cpu_adam::SimdLevelName(cpu_adam::BestSupportedSimdLevel()))},
      {"nvme_path", f.nvme_path}};
  report["quick"] = f.quick;
  struct Benchmark {
    const char* name;
    Status (*run)(const BenchAllFlags&, ordered_json&);
  };
  for (const Benchmark& b : {Benchmark{"adam", RunAdam}, Benchmark{"nvme", RunNvme},
                             Benchmark{"copies", RunCopies}, Benchmark{"pipeline", RunPipelines}}) {
    if (Status s = b.run(f, report); !s.ok()) {
      std::fprintf(stderr, "      %s failed: %s\n", b.name, s.message().c_str());
      report["errors"][b.name] = s.message();
    }
  }
  report["tiers"] = TierSummary(report);
  if (!f.out.empty()) {
    if (Status s = WriteOut(f.out, report); !s.ok()) return Fail(kExitFailure, s.message());
  }
  if (f.json) {
    std::cout << report.dump(2) << "\n";
  } else {
    PrintSummary(report);
    if (!f.out.empty()) {
      std::printf("\nWrote %s/bench.json and CSVs; charts: scripts/plot_bench.py %s\n",
                  f.out.c_str(), f.out.c_str());
    }
  }
  if (report.contains("errors")) {
    std::string failed;
    for (const auto& [name, message] : report["errors"].items()) {
      failed += (failed.empty() ? "" : ", ") + name;
    }
    return Fail(kExitFailure, failed + " could not be measured (see above); the rest was");
  }
  return kExitOk;
}

}  // namespace strata::tools
