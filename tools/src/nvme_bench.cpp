#include "nvme_bench.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <utility>

#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"
#include "strata/core/input_file.h"
#include "strata/core/log.h"
#include "strata/nvme/file.h"
#include "strata/nvme/io_engine.h"

namespace strata::tools {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::ordered_json;
using nvme::IoOp;

/// One sequential pass over [0, size): queue_depth requests of block_size in flight, each
/// completion starting the next offset with the same buffer.
class SequentialPass {
 public:
  SequentialPass(nvme::IoEngine& engine, nvme::FileId file, IoOp op, const NvmeBenchSettings& s,
                 std::span<std::byte> buffers, bool registered)
      : engine_(engine), settings_(s), slots_(s.queue_depth) {
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
      completed_bytes_ += r.bytes_done;
      if (!r.status.ok() && !failed_) {
        failed_ = true;
        error_ = r.status;
      }
    }
    // Reuse the request before this one stops counting: once nothing is outstanding, Run may
    // return and destroy the pass, so nothing of it may be touched after the count drops.
    StartNext(r);
    std::lock_guard lock(mutex_);
    --outstanding_;
    finished_cv_.notify_one();
  }

  nvme::IoEngine& engine_;
  const NvmeBenchSettings& settings_;
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

/// The extended attribute that marks a --file this command created, and so may write again.
constexpr const char* kBenchFileMark = "user.strata-bench-file";

/// What a --file that was given is to the benchmark.
enum class GivenFile {
  kAbsent,   ///< Not there: created, marked, and kept afterwards.
  kOurs,     ///< Created by an earlier run (marked): written and read.
  kForeign,  ///< Someone else's, at least --size bytes, and only read is asked: read only.
};

/// The files this process created (bench all measures one file at every setting): its own even
/// where the file system keeps no extended attributes for the mark.
std::set<std::pair<dev_t, ino_t>>& CreatedHere() {
  static std::set<std::pair<dev_t, ino_t>> files;
  return files;
}

/// What a --file that was given is, and which file it was when examined.
struct Examined {
  GivenFile given = GivenFile::kAbsent;
  dev_t device = 0;
  ino_t inode = 0;
};

/// Examines --file `path` through a descriptor of its own (no link followed), so that the
/// mark read is the file's. Refuses (FailedPrecondition) what is not a regular file, and
/// someone else's file unless only reads of --size bytes it has are asked.
Result<Examined> ExamineGivenFile(const std::string& path, uint64_t size, const std::string& rw) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
  struct stat st {};
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Examined{};
    if (err != ELOOP || lstat(path.c_str(), &st) != 0) {
      return ErrnoError("--file " + path + ": cannot examine it", err);
    }
  } else if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoError("--file " + path + ": cannot examine it", err);
  }
  char mark[8];
  const bool ours = fd >= 0 && (fgetxattr(fd, kBenchFileMark, mark, sizeof(mark)) >= 0 ||
                                CreatedHere().contains({st.st_dev, st.st_ino}));
  if (fd >= 0) close(fd);
  if (!S_ISREG(st.st_mode)) {
    return FailedPrecondition("--file " + path + " is not a regular file: it is " +
                              std::string(FileTypeName(st.st_mode)) +
                              "; give the path of a regular file (or of one to create)");
  }
  if (ours) return Examined{GivenFile::kOurs, st.st_dev, st.st_ino};
  if (rw == "read" && static_cast<uint64_t>(st.st_size) >= size) {
    return Examined{GivenFile::kForeign, st.st_dev, st.st_ino};
  }
  return FailedPrecondition(
      "--file " + path + " exists and was not created by strata bench nvme, so " +
      (rw == "read" ? "it is only read, and it holds " + FormatBytes(uint64_t(st.st_size)) +
                          ", less than --size " + FormatBytes(size)
                    : std::string("writing to it would destroy what it holds")) +
      "; give a path that does not exist (the benchmark creates the file there and may "
      "write it again later), or --rw read with a --size the file holds");
}

/// FailedPrecondition unless `file` is the one ExamineGivenFile saw at its path.
Status CheckSameFile(const nvme::File& file, const Examined& examined) {
  struct stat st {};
  if (fstat(file.fd(), &st) != 0 || st.st_dev != examined.device || st.st_ino != examined.inode) {
    return FailedPrecondition("--file " + file.path() +
                              " was replaced while the benchmark examined it; run it again");
  }
  return Status();
}

/// Marks a --file this command created as its own. Where the file system keeps no extended
/// attributes, a later run treats it as someone else's (and only reads it).
void MarkOurs(const nvme::File& file, const std::string& path) {
  struct stat st {};
  if (fstat(file.fd(), &st) == 0) CreatedHere().insert({st.st_dev, st.st_ino});
  const char value[] = "1";
  if (fsetxattr(file.fd(), kBenchFileMark, value, 1, 0) != 0) {
    Log(LogLevel::kWarning, "could not mark " + path + " as created by strata bench nvme (" +
                                std::strerror(errno) +
                                "); a later run will only read it, never write it");
  }
}

/// Removes the benchmark's scratch file however the benchmark ends.
struct RemoveOnExit {
  std::string path;  // Empty: nothing to remove.
  ~RemoveOnExit() {
    if (!path.empty()) unlink(path.c_str());
  }
};

}  // namespace

Result<std::vector<NvmePass>> RunNvmeBench(const NvmeBenchSettings& s, const std::string& rw) {
  STRATA_ASSIGN_OR_RETURN(auto engine, nvme::IoEngine::Create({.backend = s.backend,
                                                               .block_size = s.block_size,
                                                               .queue_depth = s.queue_depth}));
  const bool scratch = s.file.empty();
  const std::string path =
      scratch ? s.path + "/strata-bench-" + std::to_string(getpid()) + ".bin" : s.file;
  const RemoveOnExit cleanup{scratch ? path : std::string()};
  // A given file is written only if this command created it (its mark says so); any other is
  // at most read, and only when it already holds --size bytes: a benchmark never changes a
  // file it did not create. An existing file of ours that is large enough is used as it is
  // (fio does the same), so both tools measure overwrites of the same blocks.
  Examined examined;
  if (!scratch) {
    STRATA_ASSIGN_OR_RETURN(examined, ExamineGivenFile(path, s.size, rw));
  }
  const GivenFile given = examined.given;
  nvme::File file;
  bool reuse = false;
  if (given == GivenFile::kForeign) {
    STRATA_ASSIGN_OR_RETURN(file, nvme::File::OpenReadOnly(path, {}));
    STRATA_RETURN_IF_ERROR(CheckSameFile(file, examined));
    reuse = true;
  } else if (given == GivenFile::kOurs) {
    STRATA_ASSIGN_OR_RETURN(file, nvme::File::Open(path, {}));
    STRATA_RETURN_IF_ERROR(CheckSameFile(file, examined));
    STRATA_ASSIGN_OR_RETURN(uint64_t size, file.Size());
    reuse = size >= s.size;
    if (!reuse) STRATA_RETURN_IF_ERROR(file.Reserve(s.size));
  } else {
    STRATA_ASSIGN_OR_RETURN(file, nvme::File::Create(path, {}));
    if (!scratch) MarkOurs(file, path);
    Status reserved = file.Reserve(s.size);
    if (!reserved.ok()) {
      unlink(path.c_str());  // Created by this call, just now.
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

  std::vector<NvmePass> results;
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
  if (!status.ok()) return status;
  return results;
}

ordered_json ToJson(const NvmePass& r) {
  return {{"rw", nvme::IoOpName(r.op)},   {"block_size", r.block_size},
          {"queue_depth", r.queue_depth}, {"bytes", r.bytes},
          {"seconds", r.seconds},         {"bytes_per_second", r.bytes_per_second()},
          {"backend", r.backend}};
}

}  // namespace strata::tools
