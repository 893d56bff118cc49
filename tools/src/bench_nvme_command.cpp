// `strata bench nvme`: sequential O_DIRECT throughput through the IoEngine (nvme_bench.h), one
// setting or a sweep, as a table with the best DeepSpeed "aio" setting, or as JSON.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "nvme_bench.h"
#include "strata/core/bytes.h"

namespace strata::tools {
namespace {

using nlohmann::ordered_json;
using nvme::IoOp;

void PrintTable(const std::vector<NvmePass>& results) {
  std::printf("%-6s %10s %6s %10s %9s %12s  %s\n", "rw", "block", "qd", "bytes", "seconds",
              "bandwidth", "backend");
  for (const NvmePass& r : results) {
    std::printf("%-6s %10s %6u %10s %9.3f %12s  %s\n", nvme::IoOpName(r.op),
                FormatBytes(r.block_size).c_str(), r.queue_depth, FormatBytes(r.bytes).c_str(),
                r.seconds, FormatBandwidth(r.bytes_per_second()).c_str(), r.backend.c_str());
  }
}

/// ds_nvme_tune's job: the setting with the best harmonic mean of read and write bandwidth,
/// printed as a DeepSpeed "aio" config snippet.
void PrintBestSetting(const std::vector<NvmePass>& results) {
  double best_score = -1;
  const NvmePass* best = nullptr;
  for (const NvmePass& r : results) {
    if (r.op != IoOp::kRead) continue;
    for (const NvmePass& w : results) {
      if (w.op != IoOp::kWrite || w.block_size != r.block_size || w.queue_depth != r.queue_depth) {
        continue;
      }
      const double score = 2 / (1 / r.bytes_per_second() + 1 / w.bytes_per_second());
      if (score > best_score) {
        best_score = score;
        best = &r;
      }
    }
  }
  if (best == nullptr) return;
  std::printf("\nBest setting (harmonic mean of read and write, %s):\n",
              FormatBandwidth(best_score).c_str());
  std::printf("  \"aio\": {\"block_size\": %llu, \"queue_depth\": %u}\n",
              static_cast<unsigned long long>(best->block_size), best->queue_depth);
}

}  // namespace

int RunBenchNvme(const std::vector<std::string>& args) {
  const std::string command = "strata bench nvme";
  NvmeBenchSettings s;
  std::string rw = "both", backend = "auto";
  int64_t queue_depth = 32;
  bool json = false, sweep = false;
  FlagParser flags(command,
                   "Measure sequential O_DIRECT read and write throughput of a directory "
                   "through Strata's I/O engine (compare with bench/compare_fio.sh).");
  flags.AddString("path", &s.path, "DIR", "directory on the device to measure (required)");
  flags.AddString("rw", &rw, "MODE", "read, write or both (default both)");
  flags.AddBytes("block-size", &s.block_size, "size of each read or write (default 1MiB)");
  flags.AddInt("queue-depth", &queue_depth, "requests in flight (default 32)");
  flags.AddBytes("size", &s.size, "bytes per pass (default 4GiB)");
  flags.AddString("backend", &backend, "NAME", "auto (default), io_uring or posix");
  flags.AddString("file", &s.file, "FILE",
                  "use this file instead of a scratch file in --path: created if absent (and "
                  "kept); an existing file is written only if strata bench created it, else "
                  "only read (--rw read)");
  flags.AddBool("sweep", &sweep, "try block sizes 128KiB,1MiB,8MiB x queue depths 8,32,128");
  flags.AddBool("json", &json, "print one JSON document instead of a table");
  if (const std::optional<int> done = ParseFlags(flags, args, command)) return *done;
  if (s.path.empty() && s.file.empty()) return Fail(kExitUsage, "--path is required", command);
  if (s.path.empty()) s.path = s.file.substr(0, s.file.find_last_of('/'));
  if (rw != "read" && rw != "write" && rw != "both") {
    return Fail(kExitUsage, "--rw: expected read, write or both, got \"" + rw + "\"", command);
  }
  if (queue_depth <= 0 || queue_depth > 4096) {
    return Fail(kExitUsage, "--queue-depth: expected 1 to 4096", command);
  }
  if (s.size < s.block_size) {
    return Fail(kExitUsage, "--size must be at least --block-size", command);
  }
  auto backend_kind = ParseNvmeBackend(backend);
  if (!backend_kind.ok()) return Fail(kExitUsage, backend_kind.status().message(), command);
  s.backend = *backend_kind;
  s.queue_depth = static_cast<uint32_t>(queue_depth);
  s.progress = isatty(STDERR_FILENO) != 0 || !json;

  std::vector<std::pair<uint64_t, uint32_t>> settings = {{s.block_size, s.queue_depth}};
  if (sweep) {
    settings.clear();
    for (uint64_t block : {128 * kKiB, 1 * kMiB, 8 * kMiB}) {
      for (uint32_t depth : {8u, 32u, 128u}) settings.emplace_back(block, depth);
    }
  }
  std::vector<NvmePass> results;
  for (auto [block, depth] : settings) {
    NvmeBenchSettings one = s;
    one.block_size = block;
    one.queue_depth = depth;
    if (sweep) {
      std::fprintf(stderr, "block %s, queue depth %u\n", FormatBytes(block).c_str(), depth);
    }
    auto run = RunNvmeBench(one, sweep ? "both" : rw);
    if (!run.ok()) return Fail(kExitFailure, run.status().message());
    results.insert(results.end(), run->begin(), run->end());
  }
  if (json) {
    ordered_json doc = ordered_json::array();
    for (const NvmePass& r : results) doc.push_back(ToJson(r));
    std::cout << (results.size() == 1 ? doc[0] : doc).dump(2) << "\n";
  } else {
    PrintTable(results);
    if (sweep) PrintBestSetting(results);
  }
  return kExitOk;
}

}  // namespace strata::tools
