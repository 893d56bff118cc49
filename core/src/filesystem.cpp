#include "strata/core/filesystem.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "strata/core/aligned_buffer.h"

namespace strata {
namespace {

std::string FilesystemTypeName(int64_t magic) {
  switch (magic) {
    case EXT4_SUPER_MAGIC: return "ext4";  // Same magic for ext2/3/4.
    case XFS_SUPER_MAGIC: return "xfs";
    case BTRFS_SUPER_MAGIC: return "btrfs";
    case TMPFS_MAGIC: return "tmpfs";
    case NFS_SUPER_MAGIC: return "nfs";
    case OVERLAYFS_SUPER_MAGIC: return "overlayfs";
    case 0x2fc12fc1: return "zfs";
    case 0x65735546: return "fuse";
    default: break;
  }
  std::ostringstream out;
  out << "unknown (0x" << std::hex << magic << ")";
  return out.str();
}

/// Logical block size of the block device holding `st_dev`, from sysfs; 0 when unknown.
uint32_t LogicalBlockSize(dev_t device) {
  const std::string base =
      "/sys/dev/block/" + std::to_string(major(device)) + ":" + std::to_string(minor(device));
  // A partition's queue/ lives in its parent disk's folder.
  for (const char* suffix : {"/queue/logical_block_size", "/../queue/logical_block_size"}) {
    std::ifstream in(base + suffix);
    uint32_t size = 0;
    if (in >> size && size > 0) return size;
  }
  return 0;
}

/// Creates a scratch file with O_DIRECT, writes one aligned block, and removes it.
void ProbeDirectIo(const std::string& directory, FilesystemInfo& info) {
  std::string name = directory + "/.strata-dio-probe-XXXXXX";
  const int fd = mkostemp(name.data(), O_DIRECT | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    info.direct_io_error = std::string("cannot create a file with O_DIRECT: ") +
                           std::strerror(err) +
                           (err == EINVAL ? " (the file system does not support O_DIRECT)" : "");
    return;
  }
  const size_t block = std::max<size_t>(info.direct_io_offset_alignment, kHostAlignment);
  auto buffer = AlignedBuffer::Allocate(block);
  if (buffer.ok()) {
    std::memset(buffer->data(), 0, block);
    const ssize_t written = pwrite(fd, buffer->data(), block, 0);
    if (written == static_cast<ssize_t>(block)) {
      info.direct_io_supported = true;
    } else {
      info.direct_io_error =
          written < 0 ? std::string("an aligned O_DIRECT write failed: ") + std::strerror(errno)
                      : std::string("an aligned O_DIRECT write was short");
    }
  } else {
    info.direct_io_error = buffer.status().message();
  }
  close(fd);
  unlink(name.c_str());
}

}  // namespace

DirectIoAlignment QueryDirectIoAlignment(const std::string& path) {
#ifdef STATX_DIOALIGN
  struct statx stx {};
  if (statx(AT_FDCWD, path.c_str(), 0, STATX_DIOALIGN, &stx) == 0 &&
      (stx.stx_mask & STATX_DIOALIGN) != 0 && stx.stx_dio_offset_align != 0) {
    return {stx.stx_dio_mem_align, stx.stx_dio_offset_align, "statx(STATX_DIOALIGN)"};
  }
#endif
  struct stat st {};
  if (stat(path.c_str(), &st) == 0) {
    if (const uint32_t block = LogicalBlockSize(st.st_dev); block != 0) {
      return {block, block, "logical block size"};
    }
  }
  const auto page = static_cast<uint32_t>(sysconf(_SC_PAGESIZE));
  return {page, page, "page size (assumed)"};
}

Result<FilesystemInfo> ProbeFilesystem(const std::string& directory) {
  struct stat st {};
  if (stat(directory.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return NotFound("path " + directory + " does not exist");
    return ErrnoError("stat " + directory, err);
  }
  if (!S_ISDIR(st.st_mode)) return InvalidArgument("path " + directory + " is not a directory");
  struct statfs fs {};
  if (statfs(directory.c_str(), &fs) != 0) return ErrnoError("statfs " + directory, errno);

  FilesystemInfo info;
  info.path = directory;
  info.type = FilesystemTypeName(static_cast<int64_t>(fs.f_type));
  info.total_bytes = static_cast<uint64_t>(fs.f_blocks) * fs.f_bsize;
  info.free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_bsize;
  const DirectIoAlignment alignment = QueryDirectIoAlignment(directory);
  info.direct_io_memory_alignment = alignment.memory;
  info.direct_io_offset_alignment = alignment.offset;
  info.alignment_source = alignment.source;
  ProbeDirectIo(directory, info);
  return info;
}

}  // namespace strata
