// StagingPool: a fixed set of equal, aligned, pinned host buffers.
//
// Staging buffers serve both GPU DMA and O_DIRECT NVMe I/O, so NVMe -> host -> GPU needs no
// extra copy. Their count bounds how many chunks are in flight. The pool allocates everything
// once, within a byte budget, and never more.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "strata/core/aligned_buffer.h"
#include "strata/core/device.h"
#include "strata/core/status.h"

namespace strata {

class StagingPool;

struct StagingPoolOptions {
  /// Size of each buffer; rounded up to a multiple of kHostAlignment (4 KiB).
  uint64_t buffer_bytes = uint64_t{64} << 20;
  /// Number of buffers.
  size_t buffer_count = 4;
  /// The pool's byte budget. buffer_count x buffer_bytes must fit; 0 means exactly that much.
  uint64_t budget_bytes = 0;
  /// When set and the device can pin, the pool's memory is pinned through it once, at creation.
  /// The device must outlive the pool.
  Device* pin_with = nullptr;
};

/// One buffer lent by a StagingPool. Move-only; goes back to the pool when destroyed.
class StagingBuffer {
 public:
  StagingBuffer() = default;
  ~StagingBuffer() { Reset(); }
  StagingBuffer(StagingBuffer&& other) noexcept { *this = std::move(other); }
  StagingBuffer& operator=(StagingBuffer&& other) noexcept;
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<std::byte> span() const { return {data_, size_}; }
  bool valid() const { return pool_ != nullptr; }
  /// Position of this buffer in the pool (stable; used as the io_uring registered-buffer index).
  size_t index() const { return index_; }

  /// Returns the buffer to its pool now. Idempotent.
  void Reset();

 private:
  friend class StagingPool;
  StagingBuffer(StagingPool* pool, std::byte* data, size_t size, size_t index)
      : pool_(pool), data_(data), size_(size), index_(index) {}
  StagingPool* pool_ = nullptr;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t index_ = 0;
};

/// Thread-safe. The pool must outlive every buffer it lends (checked by assert in debug builds).
class StagingPool {
 public:
  /// Allocates (and pins, see options) buffer_count x buffer_bytes. ResourceExhausted when that
  /// exceeds the budget; InvalidArgument for zero buffers or zero bytes.
  static Result<std::unique_ptr<StagingPool>> Create(const StagingPoolOptions& options);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  /// Takes a free buffer, waiting until one is returned if none is free.
  StagingBuffer Acquire();
  /// Takes a free buffer, or fails with ResourceExhausted at once if none is free.
  Result<StagingBuffer> TryAcquire();

  size_t buffer_count() const { return buffer_count_; }
  size_t buffer_bytes() const { return buffer_bytes_; }
  size_t available() const;
  bool pinned() const { return pinned_region_.valid(); }
  /// The whole arena (all buffers, contiguous), e.g. for registering with io_uring.
  std::span<std::byte> arena() const { return memory_.span(); }

 private:
  friend class StagingBuffer;
  StagingPool(AlignedBuffer memory, size_t buffer_bytes, size_t buffer_count);
  StagingBuffer Lend(size_t index);
  void Return(size_t index);

  AlignedBuffer memory_;
  PinnedHostRegion pinned_region_;  // Declared after memory_: unpinned before it is freed.
  const size_t buffer_bytes_;
  const size_t buffer_count_;
  mutable std::mutex mutex_;
  std::condition_variable returned_;
  std::vector<size_t> free_;  // Indices of free buffers, used as a stack.
};

}  // namespace strata
