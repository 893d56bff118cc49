#include "checkpoint/checkpoint_io.h"

#include <fcntl.h>

#include <cinttypes>
#include <cstdio>

namespace strata::offload::internal {

namespace fs = std::filesystem;

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
                 std::string_view detail) {
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

}  // namespace strata::offload::internal
