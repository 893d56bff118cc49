#include "strata/nvme/swap_space.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <future>
#include <mutex>
#include <set>
#include <string_view>

#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"
#include "strata/core/log.h"
#include "strata/nvme/extent_allocator.h"
#include "strata/nvme/file.h"

namespace strata::nvme {
namespace {

constexpr std::string_view kSwapPrefix = "strata-swap-";
constexpr std::string_view kSwapSuffix = ".bin";
/// The first bytes of every swap file, in a header block of its own that no extent uses: what
/// proves a file Strata's, beside its name, before a later run removes it.
constexpr std::string_view kSwapMagic = "STRATA-SWAP\n";

}  // namespace

/// The pid in "strata-swap-<pid>-<sequence>.bin" (both decimal, the pid positive), else 0.
pid_t SwapFilePid(std::string_view name) {
  if (!name.starts_with(kSwapPrefix) || !name.ends_with(kSwapSuffix)) return 0;
  name.remove_prefix(kSwapPrefix.size());
  name.remove_suffix(kSwapSuffix.size());
  const size_t dash = name.find('-');
  if (dash == std::string_view::npos || dash == 0 || dash + 1 == name.size()) return 0;
  const std::string_view sequence = name.substr(dash + 1);
  if (!std::all_of(sequence.begin(), sequence.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return 0;
  }
  int64_t pid = 0;
  const auto [end, ec] = std::from_chars(name.data(), name.data() + dash, pid);
  if (ec != std::errc() || end != name.data() + dash || pid <= 0 || pid > INT32_MAX) return 0;
  return static_cast<pid_t>(pid);
}

namespace {

/// Whether `path` is a regular file (not a link) that starts with kSwapMagic.
bool HasSwapMagic(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return false;
  struct stat st {};
  char head[kSwapMagic.size()] = {};
  const bool ours = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
                    pread(fd, head, sizeof(head), 0) == static_cast<ssize_t>(sizeof(head)) &&
                    std::string_view(head, sizeof(head)) == kSwapMagic;
  close(fd);
  return ours;
}

/// The swap files this process has open (their paths): a file of this pid that is not among
/// them was left by an earlier process that had the same pid (containers reuse pids).
std::mutex g_open_files_mutex;
std::set<std::string> g_open_files;

/// Removes the swap files in `directory` whose owner is gone: only files of the exact name a
/// SwapSpace gives (SwapFilePid) that carry its header (HasSwapMagic), of a pid that no longer
/// exists or of this one but not open here.
void RemoveLeftovers(const std::string& directory) {
  DIR* dir = opendir(directory.c_str());
  if (dir == nullptr) return;
  while (dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    const pid_t pid = SwapFilePid(name);
    const std::string path = directory + "/" + name;
    if (pid == 0) continue;
    if (pid == getpid()) {
      std::lock_guard lock(g_open_files_mutex);
      if (g_open_files.contains(path)) continue;
    } else if (!(kill(pid, 0) != 0 && errno == ESRCH)) {
      continue;
    }
    if (!HasSwapMagic(path)) {
      Log(LogLevel::kWarning, "left " + path +
                                  ": it is named like a swap file of a run that is gone, but it "
                                  "does not start with Strata's header, so it is not Strata's");
      continue;
    }
    if (unlink(path.c_str()) == 0) {
      Log(LogLevel::kWarning,
          "removed swap file " + path + " left by a crashed run (pid " + std::to_string(pid) + ")");
    }
  }
  closedir(dir);
}

/// Writes the header block (kSwapMagic and the owner's pid) at the start of registered file
/// `id`, through the engine like every other swap write.
Status WriteSwapHeader(IoEngine& engine, FileId id, uint64_t header_bytes) {
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer header, AlignedBuffer::Allocate(header_bytes));
  std::memset(header.data(), 0, header_bytes);
  const std::string text = std::string(kSwapMagic) + "pid " + std::to_string(getpid()) + "\n";
  std::memcpy(header.data(), text.data(), text.size());
  IoRequest request;
  request.op = IoOp::kWrite;
  request.file = id;
  request.length = header_bytes;
  request.buffer = header.data();
  return engine.Execute(request).WithContext("writing the header of a swap file");
}

/// A distinct name per SwapSpace, so several engines in one process can share a path.
std::string SwapFileName(const std::string& directory) {
  static std::atomic<int> sequence{0};
  return directory + "/" + std::string(kSwapPrefix) + std::to_string(getpid()) + "-" +
         std::to_string(sequence++) + std::string(kSwapSuffix);
}

struct Part {
  size_t path;      // Index into the swap files.
  uint64_t offset;  // In that file.
  uint64_t length;  // Multiple of the alignment.
};

struct Extent {
  bool in_use = false;
  uint64_t size = 0;
  std::vector<Part> parts;
  uint64_t stored_bytes = 0;
  uint64_t checksum = 0;
};

struct SwapFile {
  File file;
  FileId id;
  ExtentAllocator allocator;  ///< Offsets from the end of the header.
  uint64_t header_bytes = 0;  ///< The header block before the extents: an O_DIRECT unit.
};

/// Several part requests that finish as one operation. Owns itself from submission until its
/// last request completes (a shared_ptr captured by its own requests would never be freed).
struct MultiRequest {
  std::vector<IoRequest> requests;
  std::atomic<size_t> remaining{0};
  std::mutex mutex;
  Status first_error;
  std::function<void(Status)> done;
};

}  // namespace

Status SwapSpaceOptions::Validate() const {
  if (paths.empty()) {
    return InvalidArgument(
        "swap space: no nvme path given; set nvme.paths "
        "(DeepSpeed: offload_optimizer.nvme_path)");
  }
  if (bytes_per_path == 0) return InvalidArgument("swap space: bytes_per_path must be positive");
  if (stripe_bytes == 0) return InvalidArgument("swap space: stripe_bytes must be positive");
  return Status();
}

class SwapSpace::Impl {
 public:
  Impl(SwapSpaceOptions options, IoEngine& engine)
      : options_(std::move(options)), engine_(engine) {}

  ~Impl() {
    for (SwapFile& swap : files_) {
      engine_.UnregisterFile(swap.id);
      unlink(swap.file.path().c_str());
      std::lock_guard lock(g_open_files_mutex);
      g_open_files.erase(swap.file.path());
    }
  }

  Status Open() {
    for (const std::string& directory : options_.paths) {
      if (access(directory.c_str(), W_OK) != 0) {
        return ErrnoError("nvme path " + directory + " is not a writable directory", errno)
            .WithContext("swap space");
      }
      RemoveLeftovers(directory);
      STRATA_ASSIGN_OR_RETURN(
          File file, File::Create(SwapFileName(directory),
                                  {.direct_io = options_.direct_io,
                                   .allow_buffered_fallback = options_.allow_buffered_fallback}));
      alignment_ = std::max<uint32_t>({alignment_, file.alignment(), 4096});
      const uint64_t header_bytes = std::max<uint64_t>(file.alignment(), 4096);
      Status reserved = file.Reserve(header_bytes + options_.bytes_per_path);
      if (!reserved.ok()) {
        unlink(file.path().c_str());
        return reserved;
      }
      STRATA_ASSIGN_OR_RETURN(FileId id, engine_.RegisterFile(file.fd(), file.path()));
      if (Status header = WriteSwapHeader(engine_, id, header_bytes); !header.ok()) {
        engine_.UnregisterFile(id);
        unlink(file.path().c_str());
        return header;
      }
      {
        std::lock_guard lock(g_open_files_mutex);
        g_open_files.insert(file.path());
      }
      files_.push_back(
          {std::move(file), id, ExtentAllocator(options_.bytes_per_path, 4096), header_bytes});
    }
    return Status();
  }

  Result<ExtentId> Allocate(uint64_t bytes) {
    std::lock_guard lock(mutex_);
    const uint64_t size = AlignUp(bytes == 0 ? 1 : bytes, alignment_);
    std::vector<Part> parts;
    if (size >= options_.stripe_bytes && files_.size() > 1) {
      const uint64_t share = AlignUp((size + files_.size() - 1) / files_.size(), alignment_);
      uint64_t left = size;
      for (size_t p = 0; p < files_.size() && left > 0; ++p) {
        const uint64_t length = std::min(share, left);
        auto offset = files_[p].allocator.Allocate(length);
        if (!offset) {
          ReleaseParts(parts);
          return Exhausted(bytes);
        }
        parts.push_back({p, *offset, length});
        left -= length;
      }
    } else {
      // The path with the most room, so small extents spread across devices too.
      size_t best = 0;
      for (size_t p = 1; p < files_.size(); ++p) {
        if (files_[p].allocator.free_bytes() > files_[best].allocator.free_bytes()) best = p;
      }
      auto offset = files_[best].allocator.Allocate(size);
      if (!offset) return Exhausted(bytes);
      parts.push_back({best, *offset, size});
    }
    size_t index = 0;
    while (index < extents_.size() && extents_[index].in_use) ++index;
    if (index == extents_.size()) extents_.emplace_back();
    extents_[index] = Extent{.in_use = true, .size = size, .parts = std::move(parts)};
    return ExtentId{static_cast<uint32_t>(index)};
  }

  void Free(ExtentId id) {
    std::lock_guard lock(mutex_);
    if (!Valid(id)) return;
    ReleaseParts(extents_[id.index].parts);
    extents_[id.index] = Extent{};
  }

  uint64_t Checksum(const std::byte* data, size_t bytes) const {
    return options_.checksums ? XXH3_64bits(data, bytes) : 0;
  }

  void Submit(IoOp op, ExtentId id, std::byte* data, size_t bytes, int registered_buffer,
              std::function<void(Status)> done, std::optional<uint64_t> given_checksum) {
    auto owned = std::make_unique<MultiRequest>();
    MultiRequest* multi = owned.get();
    uint64_t expected_checksum = 0;
    {
      std::lock_guard lock(mutex_);
      if (!Valid(id)) {
        done(InvalidArgument("swap space: extent " + std::to_string(id.index) +
                             " is not allocated"));
        return;
      }
      Extent& extent = extents_[id.index];
      if (op == IoOp::kRead) {
        bytes = extent.stored_bytes;
        if (bytes == 0) {
          done(FailedPrecondition("swap space: " + DescribeLocked(id) + " was never written"));
          return;
        }
        expected_checksum = extent.checksum;
      } else if (bytes > extent.size || bytes == 0) {
        done(InvalidArgument("swap space: writing " + std::to_string(bytes) + " bytes into " +
                             DescribeLocked(id)));
        return;
      }
      uint64_t position = 0;
      const uint64_t transfer = AlignUp(bytes, alignment_);
      for (const Part& part : extent.parts) {
        if (position >= transfer) break;
        IoRequest request;
        request.op = op;
        request.file = files_[part.path].id;
        request.offset = files_[part.path].header_bytes + part.offset;
        request.length = std::min(part.length, transfer - position);
        request.buffer = data + position;
        request.registered_buffer = registered_buffer;
        multi->requests.push_back(std::move(request));
        position += part.length;
      }
    }
    const bool checksums = options_.checksums;
    if (op == IoOp::kWrite) {
      const uint64_t checksum = given_checksum ? *given_checksum : Checksum(data, bytes);
      multi->done = [this, id, bytes, checksum, done = std::move(done)](Status status) {
        if (status.ok()) {
          std::lock_guard lock(mutex_);
          extents_[id.index].stored_bytes = bytes;
          extents_[id.index].checksum = checksum;
        }
        done(std::move(status));
      };
    } else {
      multi->done = [this, id, data, bytes, checksums, expected_checksum,
                     done = std::move(done)](Status status) {
        if (status.ok() && checksums && XXH3_64bits(data, bytes) != expected_checksum) {
          status = DataLoss("swap space: " + Describe(id) +
                            ": checksum mismatch, the data read back is not what was written");
        }
        done(std::move(status));
      };
    }
    multi->remaining = multi->requests.size();
    for (IoRequest& request : multi->requests) {
      request.on_complete = [multi](IoRequest& finished) {
        if (!finished.status.ok()) {
          std::lock_guard lock(multi->mutex);
          if (multi->first_error.ok()) multi->first_error = finished.status;
        }
        if (--multi->remaining == 0) {
          std::unique_ptr<MultiRequest> last(multi);  // Freed on return; touch nothing after.
          last->done(last->first_error);
        }
      };
    }
    // Take the pointers first: the last completion frees `multi`, possibly while we submit.
    std::vector<IoRequest*> requests;
    for (IoRequest& request : multi->requests) requests.push_back(&request);
    owned.release();
    for (IoRequest* request : requests) engine_.Submit(request);
  }

  uint64_t stored_bytes(ExtentId id) const {
    std::lock_guard lock(mutex_);
    return Valid(id) ? extents_[id.index].stored_bytes : 0;
  }
  uint64_t checksum(ExtentId id) const {
    std::lock_guard lock(mutex_);
    return Valid(id) ? extents_[id.index].checksum : 0;
  }

  std::string Describe(ExtentId id) const {
    std::lock_guard lock(mutex_);
    return DescribeLocked(id);
  }

  uint32_t alignment() const { return alignment_; }
  uint64_t capacity_bytes() const {
    std::lock_guard lock(mutex_);
    uint64_t total = 0;
    for (const SwapFile& swap : files_) total += swap.allocator.capacity();
    return total;
  }
  uint64_t free_bytes() const {
    std::lock_guard lock(mutex_);
    return FreeLocked();
  }
  std::vector<std::string> file_paths() const {
    std::vector<std::string> paths;
    for (const SwapFile& swap : files_) paths.push_back(swap.file.path());
    return paths;
  }

 private:
  bool Valid(ExtentId id) const { return id.index < extents_.size() && extents_[id.index].in_use; }

  uint64_t FreeLocked() const {
    uint64_t total = 0;
    for (const SwapFile& swap : files_) total += swap.allocator.free_bytes();
    return total;
  }

  Status Exhausted(uint64_t bytes) const {
    return ResourceExhausted(
        "swap space: cannot allocate " + FormatBytes(bytes) + ": " + FormatBytes(FreeLocked()) +
        " free of " + FormatBytes(options_.bytes_per_path * files_.size()) + " reserved in " +
        std::to_string(files_.size()) + " nvme path(s); reserve more space or add paths");
  }

  void ReleaseParts(const std::vector<Part>& parts) {
    for (const Part& part : parts) files_[part.path].allocator.Free(part.offset, part.length);
  }

  std::string DescribeLocked(ExtentId id) const {
    if (!Valid(id)) return "extent " + std::to_string(id.index) + " (not allocated)";
    const Extent& extent = extents_[id.index];
    std::string text =
        "extent " + std::to_string(id.index) + " (" + FormatBytes(extent.size) + " in ";
    for (size_t i = 0; i < extent.parts.size(); ++i) {
      const Part& part = extent.parts[i];
      if (i > 0) text += ", ";
      text += files_[part.path].file.path() + " at offset " +
              std::to_string(files_[part.path].header_bytes + part.offset);
    }
    return text + ")";
  }

  const SwapSpaceOptions options_;
  IoEngine& engine_;
  uint32_t alignment_ = 4096;
  std::vector<SwapFile> files_;
  mutable std::mutex mutex_;
  std::vector<Extent> extents_;
};

SwapSpace::SwapSpace(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SwapSpace::~SwapSpace() = default;

Result<std::unique_ptr<SwapSpace>> SwapSpace::Create(SwapSpaceOptions options, IoEngine& engine) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  auto impl = std::make_unique<Impl>(std::move(options), engine);
  STRATA_RETURN_IF_ERROR(impl->Open());
  return std::unique_ptr<SwapSpace>(new SwapSpace(std::move(impl)));
}

Result<ExtentId> SwapSpace::Allocate(uint64_t bytes) { return impl_->Allocate(bytes); }
void SwapSpace::Free(ExtentId extent) { impl_->Free(extent); }

void SwapSpace::Write(ExtentId extent, const std::byte* data, size_t bytes, int registered_buffer,
                      std::function<void(Status)> done, std::optional<uint64_t> checksum) {
  // The engine only reads from `data` for a write.
  impl_->Submit(IoOp::kWrite, extent, const_cast<std::byte*>(data), bytes, registered_buffer,
                std::move(done), checksum);
}

uint64_t SwapSpace::Checksum(const std::byte* data, size_t bytes) const {
  return impl_->Checksum(data, bytes);
}

void SwapSpace::Read(ExtentId extent, std::byte* data, int registered_buffer,
                     std::function<void(Status)> done) {
  impl_->Submit(IoOp::kRead, extent, data, 0, registered_buffer, std::move(done), std::nullopt);
}

namespace {
Status Wait(const std::function<void(std::function<void(Status)>)>& start) {
  std::promise<Status> result;
  start([&result](Status status) { result.set_value(std::move(status)); });
  return result.get_future().get();
}
}  // namespace

Status SwapSpace::WriteSync(ExtentId extent, const std::byte* data, size_t bytes,
                            int registered_buffer) {
  return Wait([&](auto done) { Write(extent, data, bytes, registered_buffer, std::move(done)); });
}

Status SwapSpace::ReadSync(ExtentId extent, std::byte* data, int registered_buffer) {
  return Wait([&](auto done) { Read(extent, data, registered_buffer, std::move(done)); });
}

uint64_t SwapSpace::stored_bytes(ExtentId extent) const { return impl_->stored_bytes(extent); }
uint64_t SwapSpace::checksum(ExtentId extent) const { return impl_->checksum(extent); }
std::string SwapSpace::Describe(ExtentId extent) const { return impl_->Describe(extent); }
uint32_t SwapSpace::alignment() const { return impl_->alignment(); }
uint64_t SwapSpace::capacity_bytes() const { return impl_->capacity_bytes(); }
uint64_t SwapSpace::free_bytes() const { return impl_->free_bytes(); }
std::vector<std::string> SwapSpace::file_paths() const { return impl_->file_paths(); }

}  // namespace strata::nvme
