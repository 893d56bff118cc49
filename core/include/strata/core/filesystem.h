// What a directory's file system offers for swap files: type, space, and O_DIRECT support with
// its alignment. Used by `strata info --path` and by the NVMe engine when it opens a path.
#pragma once

#include <cstdint>
#include <string>

#include "strata/core/status.h"

namespace strata {

struct FilesystemInfo {
  std::string path;          ///< The directory probed.
  std::string type;          ///< "ext4", "xfs", "tmpfs", ... or "unknown (0x...)".
  uint64_t total_bytes = 0;  ///< Size of the file system.
  uint64_t free_bytes = 0;   ///< Space available to this user.
  /// O_DIRECT alignment of buffer addresses and of file offsets/lengths, in bytes.
  uint32_t direct_io_memory_alignment = 0;
  uint32_t direct_io_offset_alignment = 0;
  /// Where the alignment came from: "statx(STATX_DIOALIGN)", "logical block size" or
  /// "page size (assumed)".
  std::string alignment_source;
  /// Whether a file here can be opened with O_DIRECT and written with an aligned block.
  bool direct_io_supported = false;
  /// Why not, when direct_io_supported is false.
  std::string direct_io_error;
};

/// O_DIRECT alignment of the file system holding `path` (a file or directory), asked of the
/// kernel without doing any I/O.
struct DirectIoAlignment {
  uint32_t memory = 0;  ///< Alignment of buffer addresses.
  uint32_t offset = 0;  ///< Alignment of file offsets and lengths.
  /// "statx(STATX_DIOALIGN)", "logical block size" or "page size (assumed)".
  std::string source;
};
DirectIoAlignment QueryDirectIoAlignment(const std::string& path);

/// Probes `directory` (which must exist and be writable for the O_DIRECT check; a read-only
/// directory reports direct_io_supported = false with the reason). NotFound when it does not
/// exist, InvalidArgument when it is not a directory.
Result<FilesystemInfo> ProbeFilesystem(const std::string& directory);

}  // namespace strata
