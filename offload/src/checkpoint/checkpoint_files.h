// Checkpoint files: the file layer of crash-consistent checkpoints.
//
// A checkpoint is a directory holding data files and a manifest.json that describes them. It is
// written whole into a staging directory next to its final place and then swapped in with one
// rename, so a reader only ever sees a complete checkpoint:
//
//   CheckpointWriter::Begin(dir)  makes "<dir>.tmp-<pid>" (the staging directory).
//   CreateFile / Append / Finish  write each data file there; Finish fsyncs it.
//   Commit(manifest)              writes and fsyncs manifest.json, fsyncs the staging directory,
//                                 then puts it at `dir` atomically and fsyncs the parent.
//   CheckpointReader              opens `dir`, checks the manifest and verifies every file it
//                                 reads against the size and XXH3-64 recorded by the writer.
//
// Crash consistency. Nothing at `dir` changes until Commit's rename, and by then every byte of
// the new checkpoint (data files, manifest, the staging directory's entries) is on stable
// storage. The rename is the only step that changes `dir`:
//   - `dir` absent: rename(staging, dir). A crash leaves either nothing at `dir` (there was no
//     checkpoint before) or the complete new one.
//   - `dir` present: renameat2(staging, dir, RENAME_EXCHANGE) swaps the two directories in one
//     atomic step, so `dir` holds the complete old or the complete new checkpoint, never a mix
//     and never nothing. The old one is then at the staging name and is removed (see
//     Ownership).
//   - File systems without RENAME_EXCHANGE (renameat2 fails with EINVAL, ENOSYS or EOPNOTSUPP)
//     fall back to rename(dir, "<dir>.old-<pid>") then rename(staging, dir). A crash between the
//     two renames leaves NO checkpoint at `dir`: the old one is complete at "<dir>.old-<pid>"
//     and the new one complete at "<dir>.tmp-<pid>". The next CheckpointWriter::Begin on the
//     same `dir` (after that process is gone) renames the old one back into place, so the window
//     loses the new checkpoint but never the old one. A reader inside the window gets NotFound.
// Other leftovers of a crash ("<dir>.tmp-<pid>" of a dead pid: an unfinished staging directory
// or a half-removed old checkpoint) are removed by the next Begin on the same `dir`.
//
// Ownership. Strata removes or replaces only what its content proves Strata's, never what a
// name alone suggests: `dir` is replaced only if it is absent, empty, or a checkpoint and
// nothing else (CheckReplaceable: a verified manifest whose "contents" lists every other
// entry); a leftover "<dir>.tmp-<pid>" only if it holds the staging marker (and, if it holds a
// manifest, nothing but that checkpoint) or is empty; a leftover "<dir>.old-<pid>" is put back
// or removed only if CheckReplaceable accepts it. What fails these checks is left, with a
// warning; a previous checkpoint that gained someone else's file during the save is moved to
// "<dir>.kept-XXXXXX" instead of being removed.
//
// Only one writer at a time may target a given `dir` (the staging name is per process, and a
// second writer in the same process would remove the first one's staging directory).
//
// Where it is written: checkpoint_writer.cpp (staging, sinks, the commit), checkpoint_reader.cpp
// (verified reads), checkpoint_ownership.cpp (manifests checked, what may be replaced or
// removed) and checkpoint_io.cpp (the POSIX calls and their errors).
//
// None of these classes is thread-safe: use each object from one thread at a time. Distinct
// CheckpointFileSinks of one writer may be used on different threads at once.
#pragma once

#include <sys/statvfs.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "strata/core/status.h"

namespace strata::offload::internal {

/// The manifest's "format" value that marks a Strata checkpoint.
inline constexpr std::string_view kCheckpointFormat = "strata-checkpoint";
/// The newest manifest "version" this build reads (and NewManifest writes): 2 adds checkpoints
/// saved by several ranks, one file per rank and chunk (checkpoint_manifest.h).
inline constexpr int kCheckpointFormatVersion = 2;
/// Name of the manifest inside a checkpoint directory; not usable as a data file name.
inline constexpr std::string_view kManifestFileName = "manifest.json";
/// An empty file Begin creates in every staging directory, so that a leftover staging directory
/// is recognised as Strata's by its content and not by its name alone. It stays in the committed
/// checkpoint, listed in the manifest's "contents" like every other file.
inline constexpr std::string_view kStagingMarkerName = ".strata-checkpoint";

/// Size and XXH3-64 hash of a whole file's content. Recorded in the manifest by the engine and
/// checked by CheckpointReader::ReadFile.
struct FileDigest {
  uint64_t bytes = 0;  ///< File size in bytes.
  uint64_t xxh3 = 0;   ///< XXH3_64bits (seed 0) of the file's content.

  friend bool operator==(const FileDigest&, const FileDigest&) = default;
};

/// Returns {"format": "strata-checkpoint", "version": kCheckpointFormatVersion}: the manifest
/// header that Commit requires and CheckpointReader::Open checks. The engine adds its own keys to
/// it.
nlohmann::json NewManifest();

/// The bytes a checkpoint may fill on a file system `space` describes (statvfs): the blocks
/// available to unprivileged users, or for a privileged writer the free ones (root may fill the
/// blocks reserved for it). nullopt when the file system reports no capacity at all (some FUSE
/// file systems), where no check can be made.
std::optional<uint64_t> UsableBytes(const struct statvfs& space, bool privileged);

/// The manifest's own checksum: "xxh3:" and 16 hex digits of the XXH3-64 of `manifest`'s compact
/// JSON text without its "checksum" member. nlohmann::json keeps members sorted and prints
/// numbers so that they parse back to the same value, so the text is canonical: any edit of a
/// value changes it, whitespace does not. Commit adds it; CheckpointReader::Open checks it
/// before any other field is read.
std::string ManifestChecksum(const nlohmann::json& manifest);

/// OK when a checkpoint may be committed at `dir` in place of what is there: nothing, an empty
/// directory, or a Strata checkpoint and nothing else (a manifest whose checksum holds, and
/// every other entry one of the files its "contents" lists). Strata never replaces or removes
/// anything it cannot prove it wrote: FailedPrecondition otherwise, naming `dir`, what is in it and
/// what to do; InvalidArgument when it is not a directory. `dir` must already be resolved
/// (symbolic links followed, as Begin does). A manifest without a checksum (written before
/// manifests had one) vouches for the files its chunks name.
Status CheckReplaceable(const std::filesystem::path& dir);

/// Everything Begin checks before it writes, without writing anything that stays: that `dir`
/// names a directory whose parent exists, that a checkpoint may replace what is at `dir`
/// (CheckReplaceable), that the parent's file system is writable (a scratch file is created and
/// removed; a read-only file system says so) and has `bytes_needed` free. For a trainer to call
/// before its first step, so that a run that cannot save fails before it trains.
Status CheckCheckpointTarget(const std::filesystem::path& dir, uint64_t bytes_needed);

/// Reads the whole file at `path` and returns its size and XXH3-64. NotFound when it does not
/// exist, IoError on a read error. For tests and diagnostics.
Result<FileDigest> DigestFile(const std::filesystem::path& path);

/// One data file being written into a checkpoint's staging directory: a move-only handle that
/// owns the file descriptor (closed on destruction) and a streaming XXH3-64 state.
///
/// Bytes go in with Append, in as many calls of any size as convenient; Finish makes them
/// durable and returns the digest. A sink destroyed without a successful Finish leaves a partial,
/// unsynced file, and the writer's Commit then refuses to commit. After any error the sink is
/// failed: later calls return FailedPrecondition.
///
/// Not thread-safe; sinks are independent of each other and of the writer's object (they may
/// outlive it), so different sinks may be used on different threads at once.
class CheckpointFileSink {
 public:
  /// An empty sink: every call fails with FailedPrecondition. Assign a real one from CreateFile.
  CheckpointFileSink();
  ~CheckpointFileSink();
  CheckpointFileSink(CheckpointFileSink&& other) noexcept;
  CheckpointFileSink& operator=(CheckpointFileSink&& other) noexcept;
  CheckpointFileSink(const CheckpointFileSink&) = delete;
  CheckpointFileSink& operator=(const CheckpointFileSink&) = delete;

  /// Writes all of `bytes` at the end of the file (short writes are continued, EINTR retried)
  /// and adds them to the hash. IoError naming the file, the operation and the errno text; a
  /// full disk (ENOSPC/EDQUOT) says so. The caller keeps ownership of `bytes`; nothing is kept
  /// after the call returns.
  Status Append(std::span<const std::byte> bytes);

  /// fsyncs and closes the file and returns its size and XXH3-64. After Finish the sink is
  /// closed; a second Finish or an Append fails with FailedPrecondition.
  Result<FileDigest> Finish();

  /// Full path of the file in the staging directory (empty for an empty sink).
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  /// Bytes appended so far.
  [[nodiscard]] uint64_t bytes_written() const { return bytes_; }

 private:
  friend class CheckpointWriter;
  struct HashState;  // Wraps XXH3_state_t, so this header does not include xxhash.h.
  struct HashStateDeleter {
    void operator()(HashState* state) const;
  };
  struct SharedState;  // Shared with the writer: counts sinks not yet finished.

  CheckpointFileSink(int fd, std::filesystem::path path,
                     std::unique_ptr<HashState, HashStateDeleter> hash,
                     std::shared_ptr<SharedState> shared);
  /// Closes the fd (if open) and settles the writer's count of open sinks.
  void Release(bool finished);

  int fd_ = -1;
  std::filesystem::path path_;
  uint64_t bytes_ = 0;
  bool failed_ = false;
  std::unique_ptr<HashState, HashStateDeleter> hash_;
  std::shared_ptr<SharedState> shared_;
};

/// Writes one checkpoint into a staging directory and commits it atomically at its final path.
/// Move-only; owns the staging directory until Commit succeeds. A writer destroyed without a
/// successful Commit removes its staging directory (best effort) and leaves `dir` untouched.
/// Not thread-safe: one thread at a time (its sinks may be on other threads, see above).
class CheckpointWriter {
 public:
  ~CheckpointWriter();
  CheckpointWriter(CheckpointWriter&& other) noexcept;
  CheckpointWriter& operator=(CheckpointWriter&& other) noexcept;
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  /// Starts a checkpoint whose final path is `dir` (symbolic links in it are resolved, so the
  /// staging directory is on the same file system as the real target). The parent of `dir` must
  /// exist (NotFound naming it otherwise; InvalidArgument if it is not a directory; IoError with
  /// the errno text if it cannot be examined) and `dir`, if it exists, must be a directory
  /// (InvalidArgument otherwise). Creates a fresh staging directory "<dir>.tmp-<pid>", removing a
  /// stale one of that name first, and cleans up after crashed writers of the same `dir` (see
  /// the file comment). With `bytes_needed` (the data files' total), ResourceExhausted naming
  /// both sizes when the file system has less free, before anything is written.
  static Result<CheckpointWriter> Begin(const std::filesystem::path& dir,
                                        uint64_t bytes_needed = 0);

  /// Joins the checkpoint that a writer in process `pid` began at `dir` (Begin), for the other
  /// ranks of a sharded engine: files created here go into that writer's staging directory. A
  /// joined writer never commits (the one that began it does, once every rank has finished its
  /// files) and never removes the staging directory. NotFound when that directory is not
  /// there (`dir` is not on a file system every rank shares); the errors of Begin for `dir`.
  static Result<CheckpointWriter> Join(const std::filesystem::path& dir, int64_t pid);

  /// Creates the data file `name` in the staging directory and returns its sink. `name` must be
  /// a plain file name: not empty, no '/', not "." or "..", not "manifest.json"
  /// (InvalidArgument). AlreadyExists if this checkpoint already has a file of that name.
  /// FailedPrecondition after Commit.
  Result<CheckpointFileSink> CreateFile(std::string_view name);

  /// DataLoss naming the first of `files` (name, expected size) that is not in the staging
  /// directory with that size: what the writer that began a checkpoint checks of the files
  /// other processes wrote through Join before it commits. A rank whose `dir` is not on the
  /// same file system may still find a directory of the staging directory's name (a leftover
  /// of an earlier run on its node) and write there; committing without its files would
  /// replace a good checkpoint with one that cannot load.
  Status CheckFilesPresent(std::span<const std::pair<std::string, uint64_t>> files) const;

  /// Writes `manifest` as manifest.json (2-space indent) with two members of the file layer's
  /// own, which it overwrites if present: "contents", every file of the staging directory (what
  /// CheckReplaceable accepts later), and "checksum" (ManifestChecksum). Makes it and the staging
  /// directory durable and puts the checkpoint at `dir`, replacing any previous checkpoint there
  /// atomically (see the file comment), then removes the previous one.
  ///
  /// InvalidArgument if `manifest` is not an object with "format": "strata-checkpoint" and an
  /// integer "version" this build supports (start from NewManifest()), or if it cannot be
  /// serialized (e.g. a string that is not UTF-8). FailedPrecondition if a sink of this writer is
  /// still open, or one failed or was destroyed before a successful Finish (its data is not
  /// durable), or after a successful Commit. IoError on a file system error: `dir` is unchanged
  /// and Commit may be retried, except when the message says the checkpoint was committed but
  /// syncing the parent directory failed (the new checkpoint is in place but may not survive a
  /// crash). FailedPrecondition for a writer that joined another's (Join). Failing to remove the
  /// old checkpoint afterwards only logs a warning; the next Begin removes it. `keep_previous`:
  /// the previous checkpoint is left for RemovePrevious, so that a sharded save's ranks agree on
  /// the commit before the first rank spends time removing it.
  Status Commit(const nlohmann::json& manifest, bool keep_previous = false);
  /// Removes the checkpoint a Commit(manifest, true) replaced, if any (best effort: a failure
  /// logs a warning; the next Begin removes it). The destructor does too.
  void RemovePrevious();

  /// The final path: Begin's `dir` with symbolic links resolved.
  [[nodiscard]] const std::filesystem::path& dir() const { return dir_; }
  /// The staging directory ("<dir>.tmp-<pid>").
  [[nodiscard]] const std::filesystem::path& staging_dir() const { return staging_; }
  /// The process whose staging directory it is (what Join takes).
  [[nodiscard]] int64_t staging_pid() const { return staging_pid_; }

 private:
  CheckpointWriter(std::filesystem::path dir, std::filesystem::path staging, int64_t pid,
                   bool owns_staging);
  /// Removes the staging directory of a writer that began it and did not commit.
  void Abandon();
  /// Moves the staging directory to dir_ (rename or exchange); the old checkpoint goes to
  /// previous_.
  Status Publish();

  std::filesystem::path dir_;
  std::filesystem::path staging_;
  int64_t staging_pid_ = 0;
  bool owns_staging_ = true;  // Begin's writer; false for one that joined it.
  bool committed_ = false;
  std::filesystem::path previous_;  // The checkpoint Commit replaced, until removed.
  std::shared_ptr<CheckpointFileSink::SharedState> shared_;
};

/// A committed checkpoint opened for reading: its parsed manifest and verified file reads.
/// A plain value (copyable, movable) that holds no open files between calls. Not thread-safe for
/// mutation (assignment), but its const calls (manifest(), ReadFile) may run on several threads
/// at once, each ReadFile with its own buffer.
class CheckpointReader {
 public:
  /// Reads and checks `dir`/manifest.json (through OpenInputFile: a regular file, not a link,
  /// within kManifestInput's size). NotFound if `dir` or the manifest does not exist (the
  /// message says it is not a Strata checkpoint); DataLoss if the manifest is not valid JSON
  /// (with the parser's message), not a JSON object, or without a checksum that matches its
  /// content (checked after the format and version, before anything else); InvalidArgument if its
  /// "format" is not "strata-checkpoint" or its "version" is not an integer from 1 to
  /// kCheckpointFormatVersion (a newer version names both versions), or if `dir` is a file; IoError
  /// on a read error.
  static Result<CheckpointReader> Open(const std::filesystem::path& dir);

  /// Called by ReadFile with each piece of the file in order: `piece` is valid only during the
  /// call (it points into ReadFile's buffer), `offset` is its position in the file. A non-OK
  /// return stops the read and is returned by ReadFile unchanged.
  using ConsumeFn = std::function<Status(std::span<const std::byte> piece, uint64_t offset)>;

  /// Reads the whole data file `name` through an internal buffer, hashing as it goes, and hands
  /// it to `consume` in order, in pieces of `piece_bytes` (the last one may be shorter). Returns
  /// DataLoss naming the file if it is missing ("checkpoint is incomplete"), if its size differs
  /// from `expected.bytes` (checked before any piece is consumed) or if its XXH3-64 differs from
  /// `expected.xxh3` (the message gives expected and actual size and hash in hex).
  ///
  /// Hazard: the hash is known only at the end, so `consume` may already have received bad
  /// bytes when DataLoss is returned. On any non-OK return the caller must treat everything
  /// `consume` wrote as garbage (the engine loads into scratch buffers and only then publishes).
  /// `consume` is never given bytes past `expected.bytes`. InvalidArgument for a bad `name` or a
  /// zero `piece_bytes`; IoError on a read error.
  Status ReadFile(std::string_view name, const FileDigest& expected, const ConsumeFn& consume,
                  size_t piece_bytes = size_t{8} << 20) const;

  /// The parsed manifest, including "format" and "version".
  [[nodiscard]] const nlohmann::json& manifest() const { return manifest_; }
  /// The checkpoint directory given to Open.
  [[nodiscard]] const std::filesystem::path& dir() const { return dir_; }

 private:
  CheckpointReader(std::filesystem::path dir, nlohmann::json manifest)
      : dir_(std::move(dir)), manifest_(std::move(manifest)) {}

  std::filesystem::path dir_;
  nlohmann::json manifest_;
};

}  // namespace strata::offload::internal
