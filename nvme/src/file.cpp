#include "strata/nvme/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "strata/core/bytes.h"
#include "strata/core/filesystem.h"
#include "strata/core/log.h"

namespace strata::nvme {
namespace {

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

}  // namespace

File::~File() {
  if (fd_ >= 0) close(fd_);
}

File::File(File&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      path_(std::move(other.path_)),
      direct_(other.direct_),
      alignment_(other.alignment_) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    direct_ = other.direct_;
    alignment_ = other.alignment_;
  }
  return *this;
}

Result<File> File::Create(const std::string& path, const FileOptions& options) {
  return OpenWithFlags(path, options, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC);
}

Result<File> File::Open(const std::string& path, const FileOptions& options) {
  return OpenWithFlags(path, options, O_RDWR | O_CLOEXEC);
}

Result<File> File::OpenReadOnly(const std::string& path, const FileOptions& options) {
  return OpenWithFlags(path, options, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
}

Result<uint64_t> File::Size() const {
  struct stat st {};
  if (fstat(fd_, &st) != 0) return ErrnoError("fstat " + path_, errno);
  return static_cast<uint64_t>(st.st_size);
}

Result<File> File::OpenWithFlags(const std::string& path, const FileOptions& options, int flags) {
  File file;
  file.path_ = path;
  if (options.direct_io) {
    file.fd_ = open(path.c_str(), flags | O_DIRECT, 0600);
    if (file.fd_ >= 0) {
      file.direct_ = true;
      const DirectIoAlignment alignment = QueryDirectIoAlignment(path);
      file.alignment_ = std::max(alignment.offset, alignment.memory);
      return file;
    }
    if (errno != EINVAL) return ErrnoError("opening " + path, errno);
    auto fs = ProbeFilesystem(DirectoryOf(path));
    const std::string fs_type = fs.ok() ? fs->type : "a file system";
    const std::string problem = "nvme path " + DirectoryOf(path) + " is on " + fs_type +
                                ", which does not support O_DIRECT";
    if (!options.allow_buffered_fallback) {
      return InvalidArgument(problem +
                             "; use a real file system, or set nvme.allow_buffered_fallback "
                             "(or nvme.direct_io=false) to accept buffered I/O");
    }
    Log(LogLevel::kWarning, problem + "; using buffered I/O, which goes through the page cache");
  }
  file.fd_ = open(path.c_str(), flags, 0600);
  if (file.fd_ < 0) return ErrnoError("opening " + path, errno);
  return file;
}

Status File::Reserve(uint64_t bytes) {
  if (bytes == 0) return Status();
  auto no_space = [&] {
    struct statvfs fs {};
    std::string free_text = "unknown";
    if (fstatvfs(fd_, &fs) == 0) free_text = FormatBytes(uint64_t{fs.f_bavail} * fs.f_frsize);
    return ResourceExhausted("nvme path " + DirectoryOf(path_) + ": cannot reserve " +
                             FormatBytes(bytes) + " of swap space (" + free_text +
                             " free); free space there, add nvme paths, or lower the "
                             "offloaded state");
  };
  // A request past the free space is refused before fallocate: ext4 allocates block by block
  // and only then fails, filling the drive for a moment under every other process on it (the
  // other ranks' swap files, a checkpoint being written).
  struct statvfs fs {};
  if (fstatvfs(fd_, &fs) == 0 && bytes > uint64_t{fs.f_bavail} * fs.f_frsize) return no_space();
  const int result = posix_fallocate(fd_, 0, static_cast<off_t>(bytes));
  if (result == 0) return Status();
  if (result == ENOSPC || result == EFBIG) return no_space();
  return ErrnoError("reserving " + FormatBytes(bytes) + " in " + path_, result);
}

}  // namespace strata::nvme
