// InputFile: the one way Strata opens a file it reads (configs, checkpoint manifests, checkpoint
// data files, the training corpus).
//
// Outside input may be anything a path can name: a FIFO that blocks open() or read() forever,
// /dev/zero that never ends, a directory. Every reader therefore goes through OpenInputFile,
// which
//   - opens with O_NONBLOCK, so that opening a FIFO returns at once instead of waiting for a
//     writer (the flag means nothing for a regular file's reads),
//   - refuses anything but a regular file, saying what it is ("a FIFO", "a character device",
//     "a directory", ...),
//   - refuses a file larger than the limit of its kind before reading a byte,
// and ReadInputFile reads at most that limit, so no input can make Strata read without bound.
// Symbolic links are followed (a checkpoint in a Hugging Face or DVC cache is links to blobs):
// what is checked is what they lead to, and reading through a link changes nothing. Links
// matter where Strata removes or writes, and are refused there (checkpoint_writer.cpp, swap
// space, bench nvme --file).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

/// What is being read: its name in messages ("config file") and the largest size accepted.
struct InputKind {
  std::string_view what;
  uint64_t max_bytes = 0;
};

/// Configs are a few KiB; 16 MiB is far beyond any real one.
inline constexpr InputKind kConfigInput{"config file", uint64_t{16} << 20};
/// A manifest lists every parameter: about 150 bytes each, so 256 MiB covers 1.7 M parameter
/// tensors, far beyond any model.
inline constexpr InputKind kManifestInput{"checkpoint manifest", uint64_t{256} << 20};
/// A checkpoint's data file: one chunk's states (the manifest names its exact size, which the
/// reader checks; this is the outer bound).
inline constexpr InputKind kCheckpointDataInput{"checkpoint file", uint64_t{1} << 40};
/// The training text of `strata train`, held in memory whole.
inline constexpr InputKind kCorpusInput{"training corpus", uint64_t{4} << 30};

/// An open regular file for reading: a move-only handle that closes its descriptor.
class InputFile {
 public:
  InputFile() = default;
  ~InputFile();
  InputFile(InputFile&& other) noexcept;
  InputFile& operator=(InputFile&& other) noexcept;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  [[nodiscard]] int fd() const { return fd_; }
  /// Its size when opened (fstat).
  [[nodiscard]] uint64_t size() const { return size_; }
  [[nodiscard]] const std::string& path() const { return path_; }

  /// Reads up to `size` bytes at the current position, stopping early only at end of file;
  /// EINTR is retried. The count read, or IoError naming the file.
  Result<size_t> Read(void* data, size_t size);

 private:
  friend Result<InputFile> OpenInputFile(const std::string& path, const InputKind& kind);
  InputFile(int fd, uint64_t size, std::string path)
      : fd_(fd), size_(size), path_(std::move(path)) {}

  int fd_ = -1;
  uint64_t size_ = 0;
  std::string path_;
};

/// Opens `path` as described in the file comment. NotFound when it does not exist;
/// InvalidArgument when it is not a regular file (naming what it is) or larger than
/// `kind.max_bytes`; IoError for other open failures.
Result<InputFile> OpenInputFile(const std::string& path, const InputKind& kind);

/// The whole content of `path`, opened with OpenInputFile. InvalidArgument also when the file
/// grows past `kind.max_bytes` while being read.
Result<std::string> ReadInputFile(const std::string& path, const InputKind& kind);

/// "a FIFO", "a directory", "a character device", ... for a stat mode.
std::string_view FileTypeName(unsigned mode);

}  // namespace strata
