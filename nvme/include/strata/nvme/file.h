// File: an open file descriptor for swap I/O, O_DIRECT when the file system allows it.
#pragma once

#include <cstdint>
#include <string>

#include "strata/core/status.h"

namespace strata::nvme {

struct FileOptions {
  /// Open with O_DIRECT (bypass the page cache), as swap I/O should.
  bool direct_io = true;
  /// Where O_DIRECT is refused (e.g. tmpfs on older kernels): true falls back to buffered I/O
  /// with a warning; false fails with an error that says what to change.
  bool allow_buffered_fallback = false;
};

/// Move-only owner of a file descriptor. Closing is the destructor's job; removing the file is
/// the owner's decision (see SwapSpace).
class File {
 public:
  File() = default;
  ~File();
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  /// Creates a new file (it must not exist) for reading and writing.
  static Result<File> Create(const std::string& path, const FileOptions& options);
  /// Opens an existing file for reading and writing.
  static Result<File> Open(const std::string& path, const FileOptions& options);
  /// Opens an existing regular file for reading only (never a symbolic link): for measuring
  /// reads of a file Strata must not change.
  static Result<File> OpenReadOnly(const std::string& path, const FileOptions& options);

  /// Current size of the file in bytes.
  Result<uint64_t> Size() const;

  /// Preallocates `bytes` so running out of space shows now, not in the middle of a step.
  /// ResourceExhausted naming the path, the size asked and the space free.
  Status Reserve(uint64_t bytes);

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  /// Alignment that offsets, lengths and buffer addresses must have (1 when buffered).
  uint32_t alignment() const { return alignment_; }

 private:
  static Result<File> OpenWithFlags(const std::string& path, const FileOptions& options, int flags);

  int fd_ = -1;
  std::string path_;
  bool direct_ = false;
  uint32_t alignment_ = 1;
};

}  // namespace strata::nvme
