// The POSIX file operations checkpoints are written and read with: descriptors that close
// themselves, whole writes, fsync retried on EINTR, and errors that say what to do about a
// full disk or a read-only file system. Private to checkpoint/.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>

#include "strata/core/status.h"

namespace strata::offload::internal {

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

/// "0x" and 16 hex digits: a checksum in messages.
std::string Hex(uint64_t value);

/// A short rendering of a JSON value for messages (never throws on bad UTF-8).
std::string Show(const nlohmann::json& value);

/// An IoError "cannot <operation> <path><detail>: <errno text>", saying what to do about a full
/// disk.
Status FileError(std::string_view operation, const std::filesystem::path& path, int err,
                 std::string_view detail = {});

/// Writes all `size` bytes, continuing short writes and retrying EINTR. Returns 0 or the errno.
int WriteAll(int fd, const std::byte* data, size_t size);

/// fsync, retried on EINTR. Returns 0 or the errno.
int FsyncRetry(int fd);

/// fsyncs a directory so the entries created, renamed or removed in it are durable.
Status SyncDirectory(const std::filesystem::path& dir);

}  // namespace strata::offload::internal
