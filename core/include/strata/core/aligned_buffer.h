// AlignedBuffer: an owned, 4 KiB-aligned block of host memory.
//
// 4 KiB alignment serves both O_DIRECT I/O (which needs the file system's DIO alignment, at most
// a page on every file system we support) and GPU DMA. Pinning is a separate step done through
// the Device (see StagingPool), so allocation policy stays apart from pinning policy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "strata/core/status.h"

namespace strata {

inline constexpr size_t kHostAlignment = 4096;

/// Move-only owner of `size()` bytes aligned to kHostAlignment. The memory is not initialized.
/// Not thread-safe; the bytes may be shared across threads by the owner's arrangement.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  /// Allocates `bytes` rounded up to a multiple of kHostAlignment. ResourceExhausted when the
  /// system has no memory for it (the message gives the size). Zero bytes gives an empty buffer.
  static Result<AlignedBuffer> Allocate(size_t bytes);
  /// Allocate, zero-filled. Large buffers (kMappedBytes and up) come straight from the kernel,
  /// already zero, so their pages take memory only once written: a buffer kept for a rare path
  /// (a failed step's gradients) or one a configuration never writes costs address space, not
  /// resident memory.
  static Result<AlignedBuffer> AllocateZeroed(size_t bytes);
  static constexpr size_t kMappedBytes = size_t{1} << 20;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::span<std::byte> span() const { return {data_, size_}; }

 private:
  AlignedBuffer(std::byte* data, size_t size, bool mapped = false)
      : data_(data), size_(size), mapped_(mapped) {}
  void Free();
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;  // From mmap (AllocateZeroed), not aligned_alloc.
};

}  // namespace strata
