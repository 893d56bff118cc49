// `strata bench nvme`: sequential O_DIRECT throughput through the IoEngine, like fio's
// sequential jobs: block_size reads or writes, queue_depth of them in flight.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"
#include "strata/nvme/file.h"
#include "strata/nvme/io_engine.h"

namespace strata::tools {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::ordered_json;
using nvme::IoOp;

struct BenchSettings {
  std::string path;
  std::string file;  // Empty: a scratch file in `path`, removed afterwards.
  uint64_t block_size = 1 << 20;
  uint32_t queue_depth = 32;
  uint64_t size = uint64_t{4} << 30;
  NvmeBackend backend = NvmeBackend::kAuto;
  bool progress = true;
};

struct PassResult {
  IoOp op;
  uint64_t block_size;
  uint32_t queue_depth;
  uint64_t bytes;
  double seconds;
  std::string backend;
  double bytes_per_second() const { return seconds > 0 ? bytes / seconds : 0; }
};

/// One sequential pass over [0, size): queue_depth requests of block_size in flight, each
/// completion starting the next offset with the same buffer.
class SequentialPass {
 public:
  SequentialPass(nvme::IoEngine& engine, nvme::FileId file, IoOp op, const BenchSettings& s,
                 std::span<std::byte> buffers, bool registered)
      : engine_(engine), op_(op), settings_(s), slots_(s.queue_depth) {
    for (uint32_t i = 0; i < s.queue_depth; ++i) {
      nvme::IoRequest& r = slots_[i];
      r.op = op;
      r.file = file;
      r.buffer = buffers.data() + i * s.block_size;
      r.registered_buffer = registered ? static_cast<int>(i) : -1;
      r.on_complete = [this](nvme::IoRequest& done) { OnComplete(done); };
    }
  }

  Result<double> Run(const char* label) {
    const auto start = Clock::now();
    for (nvme::IoRequest& r : slots_) {
      if (!StartNext(r)) break;
    }
    std::unique_lock lock(mutex_);
    auto last_print = Clock::now();
    while (!finished_cv_.wait_for(lock, std::chrono::milliseconds(250),
                                  [&] { return outstanding_ == 0 && (done_ || failed_); })) {
      if (settings_.progress && Clock::now() - last_print > std::chrono::milliseconds(500)) {
        const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
        std::fprintf(stderr, "\r  %-6s %9s / %-9s %10s   ", label,
                     FormatBytes(completed_bytes_).c_str(), FormatBytes(settings_.size).c_str(),
                     FormatBandwidth(completed_bytes_ / elapsed).c_str());
        last_print = Clock::now();
      }
    }
    if (settings_.progress) std::fprintf(stderr, "\r%60s\r", "");
    if (failed_) return error_;
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

 private:
  /// Gives `r` the next offset and submits it; false when the file is covered.
  bool StartNext(nvme::IoRequest& r) {
    {
      std::lock_guard lock(mutex_);
      if (failed_ || next_offset_ >= settings_.size) {
        done_ = true;
        return false;
      }
      r.offset = next_offset_;
      r.length = std::min<uint64_t>(settings_.block_size, settings_.size - next_offset_);
      next_offset_ += r.length;
      ++outstanding_;
    }
    engine_.Submit(&r);
    return true;
  }

  void OnComplete(nvme::IoRequest& r) {
    {
      std::lock_guard lock(mutex_);
      --outstanding_;
      completed_bytes_ += r.bytes_done;
      if (!r.status.ok() && !failed_) {
        failed_ = true;
        error_ = r.status;
      }
    }
    if (!StartNext(r)) finished_cv_.notify_one();
  }

  nvme::IoEngine& engine_;
  IoOp op_;
  const BenchSettings& settings_;
  std::vector<nvme::IoRequest> slots_;
  std::mutex mutex_;
  std::condition_variable finished_cv_;
  uint64_t next_offset_ = 0;
  uint64_t completed_bytes_ = 0;
  uint32_t outstanding_ = 0;
  bool done_ = false;
  bool failed_ = false;
  Status error_;
};

/// Runs the asked passes: "read", "write" or "both".
Result<std::vector<PassResult>> RunBench(const BenchSettings& s, const std::string& rw) {
  STRATA_ASSIGN_OR_RETURN(auto engine, nvme::IoEngine::Create({.backend = s.backend,
                                                               .block_size = s.block_size,
                                                               .queue_depth = s.queue_depth}));
  const bool scratch = s.file.empty();
  const std::string path =
      scratch ? s.path + "/strata-bench-" + std::to_string(getpid()) + ".bin" : s.file;
  // A given file that exists and is large enough is used as it is (fio does the same), so
  // both tools measure overwrites of the same blocks.
  Result<nvme::File> existing =
      scratch ? Result<nvme::File>(NotFound(path)) : nvme::File::Open(path, {});
  const Result<uint64_t> existing_size =
      existing.ok() ? existing->Size() : Result<uint64_t>(existing.status());
  const bool reuse = existing_size.ok() && *existing_size >= s.size;
  nvme::File file;
  if (reuse) {
    file = std::move(existing).value();
  } else {
    if (!scratch) unlink(path.c_str());
    STRATA_ASSIGN_OR_RETURN(file, nvme::File::Create(path, {}));
    Status reserved = file.Reserve(s.size);
    if (!reserved.ok()) {
      unlink(path.c_str());
      return reserved;
    }
  }
  STRATA_ASSIGN_OR_RETURN(nvme::FileId id, engine->RegisterFile(file.fd(), path));
  // The buffers start on a 2MiB boundary so that the engine can put all of them on huge pages
  // (IoEngine::RegisterBuffers says why that matters).
  constexpr uint64_t kHugePage = 2 * kMiB;
  const uint64_t buffer_bytes = s.block_size * s.queue_depth;
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer memory, AlignedBuffer::Allocate(buffer_bytes + kHugePage));
  const uint64_t skip = AlignUp(reinterpret_cast<uintptr_t>(memory.data()), kHugePage) -
                        reinterpret_cast<uintptr_t>(memory.data());
  const std::span<std::byte> buffers = memory.span().subspan(skip, buffer_bytes);
  std::mt19937_64 random(42);
  for (size_t i = 0; i < buffers.size() / 8; ++i) {
    reinterpret_cast<uint64_t*>(buffers.data())[i] = random();
  }
  const bool registered = engine->RegisterBuffers(buffers, s.block_size);

  std::vector<PassResult> results;
  auto pass = [&](IoOp op, bool measured) -> Status {
    SequentialPass run(*engine, id, op, s, buffers, registered);
    STRATA_ASSIGN_OR_RETURN(double seconds, run.Run(measured ? nvme::IoOpName(op) : "layout"));
    if (measured) {
      results.push_back({op, s.block_size, s.queue_depth, s.size, seconds, engine->backend_name()});
    }
    return Status();
  };
  Status status;
  // A new file is laid out first, unmeasured, like fio's layout phase: reads of fallocated but
  // never written blocks return zeros without I/O, and first writes pay for extent conversion
  // that the swap space pays once, not every step.
  if (!reuse) status = pass(IoOp::kWrite, false);
  if (status.ok() && (rw == "write" || rw == "both")) status = pass(IoOp::kWrite, true);
  if (status.ok() && (rw == "read" || rw == "both")) status = pass(IoOp::kRead, true);
  engine->UnregisterFile(id);
  if (scratch) unlink(path.c_str());
  if (!status.ok()) return status;
  return results;
}

ordered_json ToJson(const PassResult& r) {
  return {{"rw", nvme::IoOpName(r.op)},   {"block_size", r.block_size},
          {"queue_depth", r.queue_depth}, {"bytes", r.bytes},
          {"seconds", r.seconds},         {"bytes_per_second", r.bytes_per_second()},
          {"backend", r.backend}};
}

void PrintTable(const std::vector<PassResult>& results) {
  std::printf("%-6s %10s %6s %10s %9s %12s  %s\n", "rw", "block", "qd", "bytes", "seconds",
              "bandwidth", "backend");
  for (const PassResult& r : results) {
    std::printf("%-6s %10s %6u %10s %9.3f %12s  %s\n", nvme::IoOpName(r.op),
                FormatBytes(r.block_size).c_str(), r.queue_depth, FormatBytes(r.bytes).c_str(),
                r.seconds, FormatBandwidth(r.bytes_per_second()).c_str(), r.backend.c_str());
  }
}

/// ds_nvme_tune's job: the setting with the best harmonic mean of read and write bandwidth,
/// printed as a DeepSpeed "aio" config snippet.
void PrintBestSetting(const std::vector<PassResult>& results) {
  double best_score = -1;
  const PassResult* best = nullptr;
  for (const PassResult& r : results) {
    if (r.op != IoOp::kRead) continue;
    for (const PassResult& w : results) {
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
  BenchSettings s;
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
  flags.AddString("file", &s.file, "FILE", "use this file instead of a scratch file in --path");
  flags.AddBool("sweep", &sweep, "try block sizes 128KiB,1MiB,8MiB x queue depths 8,32,128");
  flags.AddBool("json", &json, "print one JSON document instead of a table");
  if (Status st = flags.Parse(args); !st.ok()) return Fail(kExitUsage, st.message(), command);
  if (flags.help_requested()) {
    std::cout << flags.Help();
    return kExitOk;
  }
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
  std::vector<PassResult> results;
  for (auto [block, depth] : settings) {
    BenchSettings one = s;
    one.block_size = block;
    one.queue_depth = depth;
    if (sweep) {
      std::fprintf(stderr, "block %s, queue depth %u\n", FormatBytes(block).c_str(), depth);
    }
    auto run = RunBench(one, sweep ? "both" : rw);
    if (!run.ok()) return Fail(kExitFailure, run.status().message());
    results.insert(results.end(), run->begin(), run->end());
  }
  if (json) {
    ordered_json doc = ordered_json::array();
    for (const PassResult& r : results) doc.push_back(ToJson(r));
    std::cout << (results.size() == 1 ? doc[0] : doc).dump(2) << "\n";
  } else {
    PrintTable(results);
    if (sweep) PrintBestSetting(results);
  }
  return kExitOk;
}

}  // namespace strata::tools
