// Checkpoint writes: staging, streamed hashed data files, the manifest and the atomic commit.
// See checkpoint_files.h for the crash-consistency argument.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/checkpoint_ownership.h"
#include "strata/core/bytes.h"
#include "strata/core/log.h"

// RENAME_EXCHANGE comes from <linux/fs.h> (or <stdio.h> with glibc >= 2.28); the value is ABI.
#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

namespace strata::offload::internal {

namespace fs = std::filesystem;

/// The XXH3 streaming state of one sink.
struct CheckpointFileSink::HashState {
  XXH3_state_t* state = nullptr;
  ~HashState() { XXH3_freeState(state); }
};

void CheckpointFileSink::HashStateDeleter::operator()(HashState* state) const { delete state; }

/// What a writer and its sinks share. Atomic because sinks may live on other threads.
struct CheckpointFileSink::SharedState {
  std::atomic<int> open_sinks{0};  ///< Created and not yet finished or destroyed.
  std::atomic<int> unfinished{0};  ///< Failed, or destroyed without a successful Finish.
};

// ------------------------------------------------------------------------------------------------
// CheckpointFileSink.

CheckpointFileSink::CheckpointFileSink() = default;

CheckpointFileSink::CheckpointFileSink(int fd, fs::path path,
                                       std::unique_ptr<HashState, HashStateDeleter> hash,
                                       std::shared_ptr<SharedState> shared)
    : fd_(fd), path_(std::move(path)), hash_(std::move(hash)), shared_(std::move(shared)) {}

CheckpointFileSink::~CheckpointFileSink() { Release(/*finished=*/false); }

CheckpointFileSink::CheckpointFileSink(CheckpointFileSink&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      path_(std::move(other.path_)),
      bytes_(std::exchange(other.bytes_, 0)),
      failed_(std::exchange(other.failed_, false)),
      hash_(std::move(other.hash_)),
      shared_(std::move(other.shared_)) {
  other.path_.clear();
}

CheckpointFileSink& CheckpointFileSink::operator=(CheckpointFileSink&& other) noexcept {
  if (this != &other) {
    Release(/*finished=*/false);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    other.path_.clear();
    bytes_ = std::exchange(other.bytes_, 0);
    failed_ = std::exchange(other.failed_, false);
    hash_ = std::move(other.hash_);
    shared_ = std::move(other.shared_);
  }
  return *this;
}

void CheckpointFileSink::Release(bool finished) {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (shared_ != nullptr) {
    shared_->open_sinks.fetch_sub(1);
    if (!finished) shared_->unfinished.fetch_add(1);
    shared_.reset();
  }
}

Status CheckpointFileSink::Append(std::span<const std::byte> bytes) {
  if (failed_) {
    return FailedPrecondition("cannot append to checkpoint file " + path_.string() +
                              ": an earlier write to it failed");
  }
  if (fd_ < 0) {
    return FailedPrecondition(path_.empty() ? std::string("Append on an empty CheckpointFileSink")
                                            : "cannot append to checkpoint file " + path_.string() +
                                                  ": it is already finished");
  }
  if (const int err = WriteAll(fd_, bytes.data(), bytes.size()); err != 0) {
    failed_ = true;
    return FileError("write checkpoint file", path_, err, " at offset " + std::to_string(bytes_));
  }
  XXH3_64bits_update(hash_->state, bytes.data(), bytes.size());
  bytes_ += bytes.size();
  return Status::Ok();
}

Result<FileDigest> CheckpointFileSink::Finish() {
  if (failed_) {
    return FailedPrecondition("cannot finish checkpoint file " + path_.string() +
                              ": an earlier write to it failed");
  }
  if (fd_ < 0) {
    return FailedPrecondition(path_.empty()
                                  ? std::string("Finish on an empty CheckpointFileSink")
                                  : "checkpoint file " + path_.string() + " is already finished");
  }
  // After a failed fsync the page cache may have dropped the dirty pages, and a second fsync
  // can report success: the sink stays failed and the writer will not commit.
  if (const int err = FsyncRetry(fd_); err != 0) {
    failed_ = true;
    Release(/*finished=*/false);
    return FileError("fsync checkpoint file", path_, err);
  }
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0 && errno != EINTR) {
    const int err = errno;
    failed_ = true;
    Release(/*finished=*/false);
    return FileError("close checkpoint file", path_, err);
  }
  const FileDigest digest{bytes_, XXH3_64bits_digest(hash_->state)};
  Release(/*finished=*/true);
  return digest;
}

// ------------------------------------------------------------------------------------------------
// CheckpointWriter.

CheckpointWriter::CheckpointWriter(fs::path dir, fs::path staging, int64_t pid, bool owns_staging)
    : dir_(std::move(dir)),
      staging_(std::move(staging)),
      staging_pid_(pid),
      owns_staging_(owns_staging),
      shared_(std::make_shared<CheckpointFileSink::SharedState>()) {}

void CheckpointWriter::Abandon() {
  if (!committed_ && owns_staging_ && !staging_.empty()) {
    RemoveOwnedDirectory(staging_);  // Best effort; the next Begin removes what is left.
  }
}

CheckpointWriter::~CheckpointWriter() {
  Abandon();
  RemovePrevious();  // Committed with keep_previous and never removed: nothing needs it now.
}

CheckpointWriter::CheckpointWriter(CheckpointWriter&& other) noexcept
    : dir_(std::move(other.dir_)),
      staging_(std::move(other.staging_)),
      staging_pid_(other.staging_pid_),
      owns_staging_(other.owns_staging_),
      committed_(other.committed_),
      previous_(std::move(other.previous_)),
      shared_(std::move(other.shared_)) {
  other.staging_.clear();
  other.previous_.clear();
}

CheckpointWriter& CheckpointWriter::operator=(CheckpointWriter&& other) noexcept {
  if (this != &other) {
    Abandon();
    RemovePrevious();
    dir_ = std::move(other.dir_);
    staging_ = std::move(other.staging_);
    other.staging_.clear();
    staging_pid_ = other.staging_pid_;
    owns_staging_ = other.owns_staging_;
    committed_ = other.committed_;
    previous_ = std::move(other.previous_);
    other.previous_.clear();
    shared_ = std::move(other.shared_);
  }
  return *this;
}

std::optional<uint64_t> UsableBytes(const struct statvfs& space, bool privileged) {
  if (space.f_blocks == 0) return std::nullopt;
  const uint64_t blocks = privileged ? space.f_bfree : space.f_bavail;
  const uint64_t block_bytes = space.f_frsize != 0 ? space.f_frsize : space.f_bsize;
  if (block_bytes != 0 && blocks > UINT64_MAX / block_bytes) return UINT64_MAX;
  return blocks * block_bytes;
}

namespace {

/// A checkpoint's final path, checked and with symbolic links resolved, and its parent.
struct CheckpointPath {
  fs::path dir;
  fs::path parent;
  /// "<dir>.tmp-<pid>": the staging directory of a writer in process `pid`.
  fs::path Staging(int64_t pid) const {
    return parent / (dir.filename().string() + ".tmp-" + std::to_string(pid));
  }
};

Result<CheckpointPath> ResolveCheckpointPath(const fs::path& requested_dir) {
  std::error_code absolute_error;
  // Absolute from the start: a bare name ("ck") would otherwise have an empty parent, which
  // the commit's directory sync cannot open.
  fs::path dir =
      requested_dir.empty() ? requested_dir : fs::absolute(requested_dir, absolute_error);
  if (absolute_error) dir = requested_dir;
  if (!dir.empty() && !dir.has_filename()) dir = dir.parent_path();  // "a/b/" names "a/b".
  const std::string name = dir.filename().string();
  if (name.empty() || name == "." || name == "..") {
    return InvalidArgument("checkpoint path \"" + requested_dir.string() +
                           "\" does not name a directory to create; give a path such as "
                           "/checkpoints/step-1000");
  }
  fs::path parent = dir.parent_path();
  if (parent.empty()) parent = ".";
  dir = dir.lexically_normal();
  if (!dir.has_filename()) dir = dir.parent_path();

  struct stat st {};
  if (::stat(parent.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return NotFound("cannot write checkpoint " + dir.string() + ": its parent directory " +
                      parent.string() + " does not exist (" + std::strerror(err) +
                      "); create it first");
    }
    return ErrnoError("cannot write checkpoint " + dir.string() +
                          ": cannot examine its parent directory " + parent.string(),
                      err);
  }
  if (!S_ISDIR(st.st_mode)) {
    return InvalidArgument("cannot write checkpoint " + dir.string() + ": its parent " +
                           parent.string() + " is not a directory");
  }

  // Resolve symbolic links so the staging directory sits next to the real target: rename()
  // cannot cross file systems.
  std::error_code ec;
  fs::path resolved = fs::weakly_canonical(dir, ec);
  if (!ec && resolved.has_filename()) {
    dir = std::move(resolved);
    parent = dir.parent_path();
  }

  return CheckpointPath{.dir = std::move(dir), .parent = std::move(parent)};
}

/// ResourceExhausted when the file system holding `parent` has less than `bytes_needed` free
/// for this user.
Status CheckFreeSpace(const fs::path& dir, const fs::path& parent, uint64_t bytes_needed) {
  struct statvfs space {};
  if (bytes_needed == 0 || ::statvfs(parent.c_str(), &space) != 0) return Status::Ok();
  const std::optional<uint64_t> usable = UsableBytes(space, ::geteuid() == 0);
  if (usable && *usable < bytes_needed) {
    return ResourceExhausted(
        "cannot write checkpoint " + dir.string() + ": it needs " + FormatBytes(bytes_needed) +
        " and the file system holding " + parent.string() + " has " + FormatBytes(*usable) +
        " free (a previous checkpoint there stays until the new one is complete); free "
        "space there or write checkpoints elsewhere");
  }
  return Status::Ok();
}

}  // namespace

Status CheckCheckpointTarget(const fs::path& requested_dir, uint64_t bytes_needed) {
  STRATA_ASSIGN_OR_RETURN(CheckpointPath path, ResolveCheckpointPath(requested_dir));
  STRATA_RETURN_IF_ERROR(CheckReplaceable(path.dir));
  // Writable: a scratch file of a name no checkpoint uses, created and removed at once.
  std::string probe = (path.parent / (path.dir.filename().string() + ".probe-XXXXXX")).string();
  const int fd = ::mkostemp(probe.data(), O_CLOEXEC);
  if (fd < 0) {
    return FileError("create a file in", path.parent, errno)
        .WithContext("cannot write checkpoint " + path.dir.string());
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return CheckFreeSpace(path.dir, path.parent, bytes_needed);
}

Result<CheckpointWriter> CheckpointWriter::Begin(const fs::path& requested_dir,
                                                 uint64_t bytes_needed) {
  STRATA_ASSIGN_OR_RETURN(CheckpointPath path, ResolveCheckpointPath(requested_dir));
  STRATA_RETURN_IF_ERROR(CheckReplaceable(path.dir));
  const fs::path& dir = path.dir;
  const fs::path& parent = path.parent;

  CleanUpLeftovers(parent, dir);

  fs::path staging = path.Staging(::getpid());
  struct stat st {};
  if (::lstat(staging.c_str(), &st) == 0) {
    // This process's own earlier staging directory (a save that could not clean up).
    if (!IsStagingDirectory(staging)) {
      return FailedPrecondition("cannot write checkpoint " + dir.string() + ": " +
                                staging.string() +
                                ", the name of its staging directory, is taken by something "
                                "Strata did not create; move it away");
    }
    if (const std::error_code ec = RemoveOwnedDirectory(staging)) {
      return ErrnoError("cannot remove the stale staging directory " + staging.string(),
                        ec.value());
    }
  }
  // The directory first: on a read-only file system that is what fails, and says so (its
  // free space would say something misleading).
  if (::mkdir(staging.c_str(), 0755) != 0) {
    return FileError("create staging directory", staging, errno)
        .WithContext("cannot write checkpoint " + dir.string());
  }
  CheckpointWriter writer(std::move(path.dir), std::move(staging), ::getpid(),
                          /*owns_staging=*/true);
  const fs::path marker = writer.staging_ / std::string(kStagingMarkerName);
  const int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    return FileError("create", marker, errno)
        .WithContext("cannot write checkpoint " + writer.dir_.string());
  }
  ::close(fd);
  // Refused before a byte of data is written when the data cannot fit: the previous checkpoint
  // stays until the new one is complete, so both must fit at once.
  STRATA_RETURN_IF_ERROR(CheckFreeSpace(writer.dir_, parent, bytes_needed));
  return writer;
}

Result<CheckpointWriter> CheckpointWriter::Join(const fs::path& requested_dir, int64_t pid) {
  STRATA_ASSIGN_OR_RETURN(CheckpointPath path, ResolveCheckpointPath(requested_dir));
  fs::path staging = path.Staging(pid);
  struct stat st {};
  if (::stat(staging.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return NotFound("cannot write checkpoint " + path.dir.string() + ": the staging directory " +
                    staging.string() +
                    " its first rank created is not there; the checkpoint directory must be on "
                    "a file system every rank shares");
  }
  return CheckpointWriter(std::move(path.dir), std::move(staging), pid, /*owns_staging=*/false);
}

Result<CheckpointFileSink> CheckpointWriter::CreateFile(std::string_view name) {
  if (staging_.empty()) return FailedPrecondition("CreateFile on a moved-from CheckpointWriter");
  if (committed_) {
    return FailedPrecondition("cannot add file \"" + std::string(name) + "\" to checkpoint " +
                              dir_.string() + ": it is already committed");
  }
  STRATA_RETURN_IF_ERROR(ValidateFileName(name));
  fs::path path = staging_ / std::string(name);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    if (err == EEXIST) {
      return AlreadyExists("checkpoint " + dir_.string() + " already has a file named \"" +
                           std::string(name) + "\"");
    }
    return FileError("create checkpoint file", path, err);
  }
  std::unique_ptr<CheckpointFileSink::HashState, CheckpointFileSink::HashStateDeleter> hash(
      new (std::nothrow) CheckpointFileSink::HashState);
  if (hash != nullptr) hash->state = XXH3_createState();
  if (hash == nullptr || hash->state == nullptr) {
    ::close(fd);
    ::unlink(path.c_str());
    return ResourceExhausted("out of memory for the hash state of " + path.string());
  }
  XXH3_64bits_reset(hash->state);
  shared_->open_sinks.fetch_add(1);
  return CheckpointFileSink(fd, std::move(path), std::move(hash), shared_);
}

Status CheckpointWriter::CheckFilesPresent(
    std::span<const std::pair<std::string, uint64_t>> files) const {
  for (const auto& [name, bytes] : files) {
    const fs::path path = staging_ / name;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      return DataLoss("cannot commit checkpoint " + dir_.string() + ": " + name +
                      ", which another rank wrote, is not in " + staging_.string() + " (" +
                      std::strerror(errno) +
                      "); the checkpoint directory must be on a file system every rank shares, "
                      "at the same path");
    }
    if (uint64_t(st.st_size) != bytes) {
      return DataLoss("cannot commit checkpoint " + dir_.string() + ": " + path.string() +
                      " holds " + std::to_string(st.st_size) +
                      " bytes, but the rank that wrote "
                      "it wrote " +
                      std::to_string(bytes) +
                      "; the checkpoint directory must be on a file system every rank shares, "
                      "at the same path");
    }
  }
  return Status();
}

Status CheckpointWriter::Commit(const nlohmann::json& manifest, bool keep_previous) {
  if (staging_.empty()) return FailedPrecondition("Commit on a moved-from CheckpointWriter");
  if (committed_) {
    return FailedPrecondition("checkpoint " + dir_.string() + " is already committed");
  }
  const std::string what = "cannot commit checkpoint " + dir_.string();
  if (!owns_staging_) {
    return FailedPrecondition(what + ": this writer joined it; the writer that began it commits");
  }
  if (const int open = shared_->open_sinks.load(); open > 0) {
    return FailedPrecondition(what + ": " + std::to_string(open) +
                              " of its files are still open; call Finish on every "
                              "CheckpointFileSink before Commit");
  }
  if (const int unfinished = shared_->unfinished.load(); unfinished > 0) {
    return FailedPrecondition(what + ": " + std::to_string(unfinished) +
                              " of its files failed or were abandoned before Finish, so their "
                              "content is not durable");
  }
  STRATA_RETURN_IF_ERROR(
      CheckManifestHeader(manifest, "the manifest of checkpoint " + dir_.string()));
  // The manifest is written under a name of its own, then renamed: a writer killed while writing
  // it leaves no manifest.json that cannot be read, which would make its staging directory
  // unprovable as Strata's (IsStagingDirectory) and so kept by every later save.
  const fs::path manifest_path = staging_ / std::string(kManifestFileName);
  const fs::path partial_path = staging_ / (std::string(kManifestFileName) + ".partial");
  ::unlink(partial_path.c_str());  // A failed earlier Commit's.
  std::string text;
  try {
    // Every file of the staging directory, so that the next save can prove the directory holds
    // nothing but this checkpoint before it replaces it (CheckReplaceable).
    nlohmann::json sealed = manifest;
    Result<std::vector<std::string>> files = SortedEntries(staging_);
    if (!files.ok()) return files.status().WithContext(what);
    std::erase(*files, std::string(kManifestFileName));  // A retried Commit's.
    sealed["contents"] = *files;
    sealed["checksum"] = ManifestChecksum(sealed);
    text = sealed.dump(2);  // Throws on a string that is not UTF-8.
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument(what + ": the manifest cannot be written as JSON: " + e.what());
  }
  text += '\n';

  {
    ScopedFd fd(::open(partial_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) return FileError("create", partial_path, errno).WithContext(what);
    if (const int err =
            WriteAll(fd.get(), reinterpret_cast<const std::byte*>(text.data()), text.size());
        err != 0) {
      return FileError("write", partial_path, err).WithContext(what);
    }
    if (const int err = FsyncRetry(fd.get()); err != 0) {
      return FileError("fsync", partial_path, err).WithContext(what);
    }
    if (const int err = fd.Close(); err != 0) {
      return FileError("close", partial_path, err).WithContext(what);
    }
  }
  if (::rename(partial_path.c_str(), manifest_path.c_str()) != 0) {
    return FileError("rename into place", partial_path, errno).WithContext(what);
  }
  STRATA_RETURN_IF_ERROR(SyncDirectory(staging_).WithContext(what));
  STRATA_RETURN_IF_ERROR(Publish());
  if (!keep_previous) RemovePrevious();
  return Status::Ok();
}

void CheckpointWriter::RemovePrevious() {
  if (previous_.empty()) return;
  // Checked by Begin; checked again, since anything may have been put there meanwhile.
  if (const Status ours = CheckReplaceable(previous_); !ours.ok()) {
    // Kept, under a name of its own that no cleanup matches, so that the next save's staging
    // name is free.
    std::string kept = (dir_.parent_path() / (dir_.filename().string() + ".kept-XXXXXX")).string();
    // rename() replaces the empty directory mkdtemp made.
    if (::mkdtemp(kept.data()) == nullptr) {
      kept = previous_.string();
    } else if (::rename(previous_.c_str(), kept.c_str()) != 0) {
      ::rmdir(kept.c_str());
      kept = previous_.string();
    }
    Log(LogLevel::kWarning, "checkpoint " + dir_.string() +
                                " was committed; what it replaced is kept at " + kept +
                                " since it is not only Strata's: " + ours.message());
    previous_.clear();
    return;
  }
  if (const std::error_code ec = RemoveOwnedDirectory(previous_)) {
    Log(LogLevel::kWarning, "checkpoint " + dir_.string() +
                                " was committed, but removing the previous one at " +
                                previous_.string() + " failed: " + ec.message() +
                                "; the next save to this path removes it");
  }
  previous_.clear();
}

Status CheckpointWriter::Publish() {
  const std::string what = "cannot commit checkpoint " + dir_.string();
  const fs::path parent = dir_.parent_path();
  // Where the previous checkpoint ends up once the new one is in place (empty: there was none).
  fs::path old;

  struct stat st {};
  bool exists = ::lstat(dir_.c_str(), &st) == 0;
  if (!exists) {
    if (::rename(staging_.c_str(), dir_.c_str()) == 0) {
      committed_ = true;
    } else if (errno == EEXIST || errno == ENOTEMPTY) {
      exists = true;  // Something appeared at dir_ since lstat: swap with it instead.
    } else {
      return FileError("rename staging directory", staging_, errno, " to " + dir_.string())
          .WithContext(what);
    }
  }
  if (exists) {
    if (::syscall(SYS_renameat2, AT_FDCWD, staging_.c_str(), AT_FDCWD, dir_.c_str(),
                  RENAME_EXCHANGE) == 0) {
      committed_ = true;
      old = staging_;
    } else if (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) {
      // No atomic exchange here. Two renames: a crash between them leaves no checkpoint at
      // dir_, the old one at `old` (the next Begin puts it back) and the new one at staging_.
      old = parent / (dir_.filename().string() + ".old-" + std::to_string(::getpid()));
      if (Status ours = CheckReplaceable(old); !ours.ok()) return ours.WithContext(what);
      RemoveOwnedDirectory(old);
      if (::rename(dir_.c_str(), old.c_str()) != 0) {
        return FileError("rename previous checkpoint", dir_, errno, " to " + old.string())
            .WithContext(what);
      }
      if (::rename(staging_.c_str(), dir_.c_str()) != 0) {
        const Status error =
            FileError("rename staging directory", staging_, errno, " to " + dir_.string());
        if (::rename(old.c_str(), dir_.c_str()) != 0) {
          return error.WithContext(what +
                                   " (and the previous checkpoint could not be put back from " +
                                   old.string() + "; the next save restores it)");
        }
        return error.WithContext(what);
      }
      committed_ = true;
    } else {
      return FileError("exchange staging directory", staging_, errno,
                       " with the previous checkpoint " + dir_.string())
          .WithContext(what);
    }
  }

  STRATA_RETURN_IF_ERROR(SyncDirectory(parent).WithContext(
      "checkpoint " + dir_.string() + " was committed but may not survive a crash"));
  // Only once the swap is durable may the old checkpoint go: a crash could otherwise lose the
  // rename and keep the removal.
  previous_ = old;
  return Status::Ok();
}

}  // namespace strata::offload::internal
