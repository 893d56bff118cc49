// Checkpoint files: staging, streamed hashed writes, atomic commit and verified reads.
// See checkpoint_files.h for the crash-consistency argument.

#include "checkpoint/checkpoint_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/input_file.h"
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

namespace {

constexpr size_t kDigestBufferBytes = size_t{1} << 20;

/// Owns a file descriptor; closes it on destruction (errors ignored: used for reads and for
/// paths that already report an error).
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  [[nodiscard]] int get() const { return fd_; }
  /// Closes now and returns close()'s errno, or 0.
  int Close() {
    const int fd = std::exchange(fd_, -1);
    if (fd < 0 || ::close(fd) == 0 || errno == EINTR) return 0;  // Linux closes on EINTR.
    return errno;
  }

 private:
  int fd_;
};

std::string Hex(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%016" PRIx64, value);
  return text;
}

/// A short rendering of a JSON value for messages (never throws on bad UTF-8).
std::string Show(const nlohmann::json& value) {
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

/// An IoError "cannot <operation> <path><detail>: <errno text>", saying what to do about a full
/// disk.
Status FileError(std::string_view operation, const fs::path& path, int err,
                 std::string_view detail = {}) {
  std::string what = "cannot " + std::string(operation) + " " + path.string() + std::string(detail);
  Status status = ErrnoError(what, err);
  if (err == ENOSPC || err == EDQUOT) {
    return IoError(status.message() +
                   ": the disk is full (or the quota is used up); free space on the file "
                   "system holding " +
                   path.parent_path().string() + " or write checkpoints elsewhere");
  }
  if (err == EROFS) {
    return IoError(status.message() + ": " + path.parent_path().string() +
                   " is on a read-only file system; write checkpoints elsewhere");
  }
  return status;
}

/// Writes all `size` bytes, continuing short writes and retrying EINTR. Returns 0 or the errno.
int WriteAll(int fd, const std::byte* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;  // write() of a regular file never returns 0 for size > 0.
    data += n;
    size -= static_cast<size_t>(n);
  }
  return 0;
}

int FsyncRetry(int fd) {
  while (::fsync(fd) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

/// fsyncs a directory so the entries created, renamed or removed in it are durable.
Status SyncDirectory(const fs::path& dir) {
  ScopedFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return FileError("open directory", dir, errno);
  if (const int err = FsyncRetry(fd.get()); err != 0) return FileError("fsync directory", dir, err);
  return Status::Ok();
}

Status ValidateFileName(std::string_view name) {
  if (name.empty() || name == "." || name == ".." ||
      name.find_first_of(std::string_view("/\0", 2)) != std::string_view::npos) {
    return InvalidArgument("checkpoint file name \"" + std::string(name) +
                           "\" is not a plain file name: it must be non-empty, not \".\" or "
                           "\"..\", and contain no '/'");
  }
  if (name == kManifestFileName) {
    return InvalidArgument("checkpoint file name \"" + std::string(name) +
                           "\" is reserved for the manifest; choose another name");
  }
  return Status::Ok();
}

/// Checks the "format" and "version" fields. `where` names the manifest in messages.
Status CheckManifestHeader(const nlohmann::json& manifest, const std::string& where) {
  if (!manifest.is_object()) {
    return InvalidArgument(where + " must be a JSON object (start from NewManifest()), got " +
                           Show(manifest));
  }
  const auto format = manifest.find("format");
  if (format == manifest.end() || !format->is_string() ||
      format->get_ref<const std::string&>() != kCheckpointFormat) {
    return InvalidArgument(where + " is not a Strata checkpoint manifest: \"format\" is " +
                           (format == manifest.end() ? std::string("missing") : Show(*format)) +
                           ", expected \"" + std::string(kCheckpointFormat) +
                           "\" (start from NewManifest())");
  }
  const auto version = manifest.find("version");
  if (version == manifest.end() || !version->is_number_integer()) {
    return InvalidArgument(where + ": \"version\" must be an integer, got " +
                           (version == manifest.end() ? std::string("nothing") : Show(*version)));
  }
  const bool huge =
      version->is_number_unsigned() && version->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
  const int64_t number = huge ? INT64_MAX : version->get<int64_t>();
  if (number > kCheckpointFormatVersion) {
    return InvalidArgument(where + " has checkpoint format version " + Show(*version) +
                           ", but this build of Strata reads versions 1 to " +
                           std::to_string(kCheckpointFormatVersion) +
                           "; load it with the Strata release that wrote it or a newer one");
  }
  if (number < 1) {
    return InvalidArgument(where + " has checkpoint format version " + Show(*version) +
                           ", which does not exist; supported versions are 1 to " +
                           std::to_string(kCheckpointFormatVersion));
  }
  return Status::Ok();
}

/// If `name` is "<prefix><pid>" with a positive decimal pid, returns the pid, else 0.
pid_t LeftoverPid(const std::string& name, const std::string& prefix) {
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return 0;
  const char* first = name.data() + prefix.size();
  const char* last = name.data() + name.size();
  long long pid = 0;
  const auto [end, ec] = std::from_chars(first, last, pid);
  if (ec != std::errc() || end != last || *first == '+' || pid <= 0 ||
      pid > static_cast<long long>(INT32_MAX)) {
    return 0;
  }
  return static_cast<pid_t>(pid);
}

bool ProcessIsGone(pid_t pid) {
  if (pid == ::getpid()) return true;  // Our own leftover: one writer per dir at a time.
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

/// Whether `staging` is a staging directory Strata made: it holds the marker Begin creates.
/// A staging directory that holds a manifest is a committed checkpoint moved aside (the previous
/// one after an exchange): it must also be nothing but that checkpoint.
bool IsStagingDirectory(const fs::path& staging) {
  struct stat st {};
  const fs::path marker = staging / std::string(kStagingMarkerName);
  const fs::path manifest = staging / std::string(kManifestFileName);
  return ::lstat(staging.c_str(), &st) == 0 && S_ISDIR(st.st_mode) &&
         ::lstat(marker.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
         (::lstat(manifest.c_str(), &st) != 0 || CheckReplaceable(staging).ok());
}

/// Cleans up after crashed writers of `dir`: removes "<name>.tmp-<pid>" of dead pids, and for
/// "<name>.old-<pid>" of dead pids (left inside the fallback's window), puts the old checkpoint
/// back at `dir` if nothing is there, else removes it. Only what its content proves Strata's
/// (IsStagingDirectory, CheckReplaceable) is removed; anything else of such a name is left and
/// logged. Best effort; logs what it does.
void CleanUpLeftovers(const fs::path& parent, const fs::path& dir) {
  const std::string name = dir.filename().string();
  const std::string staging_prefix = name + ".tmp-";
  const std::string old_prefix = name + ".old-";
  DIR* listing = ::opendir(parent.c_str());
  if (listing == nullptr) return;
  std::vector<std::string> stale_staging;
  std::vector<std::string> stale_old;
  while (const dirent* entry = ::readdir(listing)) {
    const std::string entry_name = entry->d_name;
    if (const pid_t pid = LeftoverPid(entry_name, staging_prefix); pid > 0 && ProcessIsGone(pid)) {
      stale_staging.push_back(entry_name);
    } else if (const pid_t old_pid = LeftoverPid(entry_name, old_prefix);
               old_pid > 0 && ProcessIsGone(old_pid)) {
      stale_old.push_back(entry_name);
    }
  }
  ::closedir(listing);

  for (const std::string& entry_name : stale_old) {
    const fs::path old = parent / entry_name;
    if (const Status ours = CheckReplaceable(old); !ours.ok()) {
      Log(LogLevel::kWarning, "left " + old.string() + " in place: " + ours.message());
      continue;
    }
    struct stat st {};
    if (::lstat(dir.c_str(), &st) != 0 && errno == ENOENT) {
      if (::rename(old.c_str(), dir.c_str()) == 0) {
        SyncDirectory(parent).IgnoreError();
        Log(LogLevel::kWarning, "checkpoint " + dir.string() +
                                    " was missing after an interrupted save; restored the "
                                    "previous checkpoint from " +
                                    old.string());
        continue;
      }
    }
    std::error_code ec;
    fs::remove_all(old, ec);
    if (!ec) {
      Log(LogLevel::kWarning,
          "removed " + old.string() + ", left by an interrupted checkpoint save");
    }
  }
  for (const std::string& entry_name : stale_staging) {
    const fs::path staging = parent / entry_name;
    if (::rmdir(staging.c_str()) == 0) continue;  // Empty: made, then the writer died.
    if (!IsStagingDirectory(staging)) {
      Log(LogLevel::kWarning, "left " + staging.string() +
                                  " in place: its name is that of a checkpoint's staging "
                                  "directory, but it holds what Strata did not write there");
      continue;
    }
    std::error_code ec;
    fs::remove_all(staging, ec);
    if (!ec) {
      Log(LogLevel::kWarning,
          "removed " + staging.string() + ", left by an interrupted checkpoint save");
    }
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Free functions.

nlohmann::json NewManifest() {
  return nlohmann::json{{"format", std::string(kCheckpointFormat)},
                        {"version", kCheckpointFormatVersion}};
}

std::string ManifestChecksum(const nlohmann::json& manifest) {
  nlohmann::json body = manifest;
  if (body.is_object()) body.erase("checksum");
  const std::string text = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  char hex[24];
  std::snprintf(hex, sizeof(hex), "%016" PRIx64, XXH3_64bits(text.data(), text.size()));
  return "xxh3:" + std::string(hex);
}

namespace {

/// A manifest read and checked by ReadManifest.
struct CheckedManifest {
  nlohmann::json json;
  /// Written before manifests carried a checksum and a "contents" list: nothing vouches for
  /// its fields but the data files' own checksums, which Load still checks.
  bool legacy = false;
};

/// Reads and checks the manifest at `path`: a regular file within the manifest's size limit
/// (OpenInputFile), valid JSON, a Strata header (format, version), then its checksum, before
/// anything else in it is used. A manifest with no "checksum" member at all is a legacy one.
Result<CheckedManifest> ReadManifest(const fs::path& path) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadInputFile(path.string(), kManifestInput));
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // A parse error, or a number beyond a double (1e400: out_of_range).
    std::string message = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix.
    if (auto end = message.find("] ");
        !message.empty() && message[0] == '[' && end != std::string::npos) {
      message.erase(0, end + 2);
    }
    const auto* parse = dynamic_cast<const nlohmann::json::parse_error*>(&e);
    return DataLoss("checkpoint manifest " + path.string() + " is damaged: malformed JSON" +
                    (parse != nullptr ? " at byte " + std::to_string(parse->byte) : "") + ": " +
                    message);
  }
  if (!manifest.is_object()) {
    return DataLoss("checkpoint manifest " + path.string() +
                    " is damaged: expected a JSON object, got " + Show(manifest));
  }
  STRATA_RETURN_IF_ERROR(CheckManifestHeader(manifest, "checkpoint manifest " + path.string()));
  const auto checksum = manifest.find("checksum");
  if (checksum == manifest.end()) return CheckedManifest{std::move(manifest), /*legacy=*/true};
  if (!checksum->is_string()) {
    return DataLoss("checkpoint manifest " + path.string() + " is damaged: its checksum is " +
                    Show(*checksum) + ", not a string");
  }
  const std::string expected = ManifestChecksum(manifest);
  if (checksum->get_ref<const std::string&>() != expected) {
    return DataLoss("checkpoint manifest " + path.string() +
                    " is damaged or was edited: its checksum " + Show(*checksum) +
                    " does not match its content (" + expected +
                    "); a checkpoint's manifest is not to be changed by hand");
  }
  return CheckedManifest{std::move(manifest), /*legacy=*/false};
}

/// Every string a legacy manifest gives as a "file" (its chunks' and their shards'): the files
/// that Strata wrote there, which its "contents" lists in newer manifests.
void CollectFileNames(const nlohmann::json& value, std::vector<std::string>& names) {
  if (value.is_object()) {
    for (const auto& [key, member] : value.items()) {
      if (key == "file" && member.is_string()) names.push_back(member.get<std::string>());
      CollectFileNames(member, names);
    }
  } else if (value.is_array()) {
    for (const nlohmann::json& element : value) CollectFileNames(element, names);
  }
}

/// The names in `dir`, sorted.
Result<std::vector<std::string>> SortedEntries(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  if (ec) return ErrnoError("cannot list " + dir.string(), ec.value());
  std::sort(names.begin(), names.end());
  return names;
}

/// Up to five of `names`, quoted, for messages.
std::string SomeNames(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 5; ++i) out += (i ? ", \"" : "\"") + names[i] + "\"";
  if (names.size() > 5) out += " and " + std::to_string(names.size() - 5) + " more";
  return out;
}

}  // namespace

Status CheckReplaceable(const fs::path& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return ErrnoError("cannot examine " + dir.string(), errno);
  }
  const std::string refuse = "refusing to replace " + dir.string() + ": ";
  const std::string what_to_do =
      "; Strata replaces only an empty directory or a checkpoint it wrote, so choose a new "
      "path, or move those files away yourself";
  if (!S_ISDIR(st.st_mode)) {
    return InvalidArgument(refuse + "it is not a directory (it is " +
                           std::string(FileTypeName(st.st_mode)) +
                           "); a checkpoint is a directory, so choose another path");
  }
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> entries, SortedEntries(dir));
  if (entries.empty()) return Status::Ok();
  const bool has_manifest =
      std::find(entries.begin(), entries.end(), kManifestFileName) != entries.end();
  if (!has_manifest) {
    return FailedPrecondition(refuse + "it is not a Strata checkpoint (it has no " +
                              std::string(kManifestFileName) + ") and holds " + SomeNames(entries) +
                              what_to_do);
  }
  Result<CheckedManifest> manifest = ReadManifest(dir / std::string(kManifestFileName));
  if (!manifest.ok()) {
    return FailedPrecondition(refuse + "it is not a Strata checkpoint that can be verified (" +
                              manifest.status().message() + ")" + what_to_do);
  }
  std::vector<std::string> listed;
  const nlohmann::json& json = manifest->json;
  if (manifest->legacy) {
    CollectFileNames(json, listed);
  } else if (const auto files = json.find("contents"); files != json.end() && files->is_array()) {
    for (const nlohmann::json& name : *files) {
      if (name.is_string()) listed.push_back(name.get<std::string>());
    }
  } else {
    return FailedPrecondition(refuse +
                              "its manifest does not list the checkpoint's files, so "
                              "Strata cannot tell its own files from others" +
                              what_to_do);
  }
  std::vector<std::string> foreign;
  for (const std::string& name : entries) {
    if (name != kManifestFileName &&
        std::find(listed.begin(), listed.end(), name) == listed.end()) {
      foreign.push_back(name);
    }
  }
  if (!foreign.empty()) {
    return FailedPrecondition(refuse + "it is a Strata checkpoint, but it also holds " +
                              SomeNames(foreign) + ", which the checkpoint did not write" +
                              what_to_do);
  }
  return Status::Ok();
}

Result<FileDigest> DigestFile(const fs::path& path) {
  STRATA_ASSIGN_OR_RETURN(InputFile file, OpenInputFile(path.string(), kCheckpointDataInput));
  std::unique_ptr<std::byte[]> buffer(new (std::nothrow) std::byte[kDigestBufferBytes]);
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 &XXH3_freeState);
  if (buffer == nullptr || state == nullptr) {
    return ResourceExhausted("out of memory while hashing " + path.string());
  }
  XXH3_64bits_reset(state.get());
  FileDigest digest;
  for (;;) {
    STRATA_ASSIGN_OR_RETURN(const size_t n, file.Read(buffer.get(), kDigestBufferBytes));
    if (n == 0) break;
    XXH3_64bits_update(state.get(), buffer.get(), n);
    digest.bytes += n;
  }
  digest.xxh3 = XXH3_64bits_digest(state.get());
  return digest;
}

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
    std::error_code ec;
    fs::remove_all(staging_, ec);  // Best effort; the next Begin removes what is left.
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
    std::error_code ec;
    fs::remove_all(staging, ec);
    if (ec) {
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

  const fs::path manifest_path = staging_ / std::string(kManifestFileName);
  {
    ScopedFd fd(::open(manifest_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) return FileError("create", manifest_path, errno).WithContext(what);
    if (const int err =
            WriteAll(fd.get(), reinterpret_cast<const std::byte*>(text.data()), text.size());
        err != 0) {
      return FileError("write", manifest_path, err).WithContext(what);
    }
    if (const int err = FsyncRetry(fd.get()); err != 0) {
      return FileError("fsync", manifest_path, err).WithContext(what);
    }
    if (const int err = fd.Close(); err != 0) {
      return FileError("close", manifest_path, err).WithContext(what);
    }
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
  std::error_code ec;
  fs::remove_all(previous_, ec);
  if (ec) {
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
      std::error_code ec;
      fs::remove_all(old, ec);
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

// ------------------------------------------------------------------------------------------------
// CheckpointReader.

Result<CheckpointReader> CheckpointReader::Open(const fs::path& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return NotFound(dir.string() + " is not a Strata checkpoint: the directory does not exist");
    }
    return ErrnoError("cannot open checkpoint " + dir.string(), err);
  }
  if (!S_ISDIR(st.st_mode)) {
    return InvalidArgument(dir.string() +
                           " is not a Strata checkpoint: it is a file; a checkpoint is a "
                           "directory holding manifest.json");
  }
  const fs::path manifest_path = dir / std::string(kManifestFileName);
  try {
    Result<CheckedManifest> manifest = ReadManifest(manifest_path);
    if (!manifest.ok() && manifest.status().code() == StatusCode::kNotFound) {
      return NotFound(dir.string() + " is not a Strata checkpoint: its manifest " +
                      manifest_path.string() + " is missing");
    }
    STRATA_RETURN_IF_ERROR(manifest.status());
    if (manifest->legacy) {
      Log(LogLevel::kWarning, "checkpoint manifest " + manifest_path.string() +
                                  " has no checksum (written by an older Strata, or the checksum "
                                  "was removed by hand): its fields are taken as they are; the "
                                  "data files' checksums are still checked");
    }
    nlohmann::json checked = std::move(manifest->json);
    // The file layer's own members, verified and used here; the caller gets what it committed.
    checked.erase("checksum");
    checked.erase("contents");
    return CheckpointReader(dir, std::move(checked));
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory while reading " + manifest_path.string());
  } catch (const std::exception& e) {
    return Internal("unexpected error while reading " + manifest_path.string() + ": " + e.what());
  }
}

Status CheckpointReader::ReadFile(std::string_view name, const FileDigest& expected,
                                  const ConsumeFn& consume, size_t piece_bytes) const {
  STRATA_RETURN_IF_ERROR(ValidateFileName(name));
  if (piece_bytes == 0) {
    return InvalidArgument("ReadFile of checkpoint file \"" + std::string(name) +
                           "\": piece_bytes must be positive");
  }
  const fs::path path = dir_ / std::string(name);
  Result<InputFile> file = OpenInputFile(path.string(), kCheckpointDataInput);
  if (!file.ok()) {
    if (file.status().code() == StatusCode::kNotFound) {
      return DataLoss("checkpoint " + dir_.string() + " is incomplete: file " + std::string(name) +
                      " is missing");
    }
    return file.status().code() == StatusCode::kInvalidArgument ? DataLoss(file.status().message())
                                                                : file.status();
  }
  const std::string expected_text =
      std::to_string(expected.bytes) + " bytes with xxh3 " + Hex(expected.xxh3);
  if (file->size() != expected.bytes) {
    return DataLoss("checkpoint file " + path.string() + " is " +
                    (file->size() < expected.bytes ? "truncated" : "longer than written") +
                    ": it has " + std::to_string(file->size()) + " bytes, the manifest expects " +
                    expected_text);
  }
  ::posix_fadvise(file->fd(), 0, 0, POSIX_FADV_SEQUENTIAL);

  const size_t buffer_bytes =
      static_cast<size_t>(std::max<uint64_t>(1, std::min<uint64_t>(piece_bytes, expected.bytes)));
  std::unique_ptr<std::byte[]> buffer(new (std::nothrow) std::byte[buffer_bytes]);
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 &XXH3_freeState);
  if (buffer == nullptr || state == nullptr) {
    return ResourceExhausted("out of memory for a " + std::to_string(buffer_bytes) +
                             "-byte read buffer for " + path.string() + "; lower piece_bytes");
  }
  XXH3_64bits_reset(state.get());

  uint64_t offset = 0;
  while (offset < expected.bytes) {
    const size_t want =
        static_cast<size_t>(std::min<uint64_t>(buffer_bytes, expected.bytes - offset));
    Result<size_t> n = file->Read(buffer.get(), want);
    if (!n.ok()) return n.status().WithContext("at offset " + std::to_string(offset));
    if (*n < want) {  // Shrunk since fstat.
      return DataLoss("checkpoint file " + path.string() + " is truncated: it ended after " +
                      std::to_string(offset + *n) + " bytes, the manifest expects " +
                      expected_text);
    }
    XXH3_64bits_update(state.get(), buffer.get(), want);
    STRATA_RETURN_IF_ERROR(consume(std::span<const std::byte>(buffer.get(), want), offset));
    offset += want;
  }
  std::byte extra[1];
  STRATA_ASSIGN_OR_RETURN(const size_t tail, file->Read(extra, 1));
  if (tail > 0) {  // Grew since fstat.
    return DataLoss("checkpoint file " + path.string() +
                    " is longer than written: it has more than the " + expected_text +
                    " the manifest expects");
  }
  const uint64_t actual = XXH3_64bits_digest(state.get());
  if (actual != expected.xxh3) {
    return DataLoss("checkpoint file " + path.string() +
                    " is corrupt: its content does not match its checksum: expected " +
                    expected_text + ", found " + std::to_string(offset) + " bytes with xxh3 " +
                    Hex(actual));
  }
  return Status::Ok();
}

}  // namespace strata::offload::internal
