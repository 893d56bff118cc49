#include "strata/core/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <new>
#include <utility>

#include "strata/core/bytes.h"

namespace strata {

std::string_view FileTypeName(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFIFO: return "a FIFO";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFSOCK: return "a socket";
    case S_IFLNK: return "a symbolic link";
    default: return "not a file";
  }
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

InputFile::InputFile(InputFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), size_(other.size_), path_(std::move(other.path_)) {}

InputFile& InputFile::operator=(InputFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
    path_ = std::move(other.path_);
  }
  return *this;
}

Result<size_t> InputFile::Read(void* data, size_t size) {
  auto* bytes = static_cast<char*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd_, bytes + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("cannot read " + path_, errno);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

Result<InputFile> OpenInputFile(const std::string& path, const InputKind& kind) {
  const std::string what = std::string(kind.what) + " " + path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return NotFound(what + " does not exist");
    return ErrnoError("cannot open " + what, err);
  }
  InputFile file(fd, 0, path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoError("cannot examine " + what, errno);
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgument(what + " is not a regular file: it is " +
                           std::string(FileTypeName(st.st_mode)));
  }
  if (static_cast<uint64_t>(st.st_size) > kind.max_bytes) {
    return InvalidArgument(what + " is larger than any " + std::string(kind.what) + " (" +
                           FormatBytes(static_cast<uint64_t>(st.st_size)) + ", the limit is " +
                           FormatBytes(kind.max_bytes) + ")");
  }
  // Reads of a regular file never return EAGAIN; clear the flag anyway so that nothing that
  // reads the descriptor later has to think about it.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  file.size_ = static_cast<uint64_t>(st.st_size);
  return file;
}

Result<std::string> ReadInputFile(const std::string& path, const InputKind& kind) {
  STRATA_ASSIGN_OR_RETURN(InputFile file, OpenInputFile(path, kind));
  std::string text;
  try {
    text.resize(static_cast<size_t>(file.size()));
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory reading " + std::string(kind.what) + " " + path + " (" +
                             FormatBytes(file.size()) + ")");
  }
  STRATA_ASSIGN_OR_RETURN(size_t got, file.Read(text.data(), text.size()));
  text.resize(got);
  // A file that grew since fstat (still being written, or hostile) may not exceed the limit.
  char extra[4096];
  for (;;) {
    STRATA_ASSIGN_OR_RETURN(size_t more, file.Read(extra, sizeof(extra)));
    if (more == 0) break;
    if (text.size() + more > kind.max_bytes) {
      return InvalidArgument(std::string(kind.what) + " " + path + " is larger than any " +
                             std::string(kind.what) + " (it grew past the limit of " +
                             FormatBytes(kind.max_bytes) + " while being read)");
    }
    text.append(extra, more);
  }
  return text;
}

}  // namespace strata
