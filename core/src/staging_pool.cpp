#include "strata/core/staging_pool.h"

#include <cassert>
#include <numeric>

#include "strata/core/bytes.h"

namespace strata {

StagingBuffer& StagingBuffer::operator=(StagingBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    index_ = other.index_;
  }
  return *this;
}

void StagingBuffer::Reset() {
  if (pool_ != nullptr) pool_->Return(index_);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

StagingPool::StagingPool(AlignedBuffer memory, size_t buffer_bytes, size_t buffer_count)
    : memory_(std::move(memory)), buffer_bytes_(buffer_bytes), buffer_count_(buffer_count) {
  free_.resize(buffer_count);
  // Lowest index on top of the stack, so a lightly used pool keeps touching the same buffers.
  std::iota(free_.rbegin(), free_.rend(), size_t{0});
}

StagingPool::~StagingPool() {
  assert(free_.size() == buffer_count_ && "a StagingBuffer outlived its StagingPool");
}

Result<std::unique_ptr<StagingPool>> StagingPool::Create(const StagingPoolOptions& options) {
  if (options.buffer_count == 0 || options.buffer_bytes == 0) {
    return InvalidArgument("staging pool: buffer_count and buffer_bytes must be positive (got " +
                           std::to_string(options.buffer_count) + " x " +
                           FormatBytes(options.buffer_bytes) + ")");
  }
  const uint64_t buffer_bytes = AlignUp(options.buffer_bytes, kHostAlignment);
  if (buffer_bytes > UINT64_MAX / options.buffer_count) {
    return InvalidArgument("staging pool: buffer_count x buffer_bytes overflows");
  }
  const uint64_t total = buffer_bytes * options.buffer_count;
  if (options.budget_bytes != 0 && total > options.budget_bytes) {
    return ResourceExhausted("staging pool: " + std::to_string(options.buffer_count) +
                             " buffers of " + FormatBytes(buffer_bytes) + " need " +
                             FormatBytes(total) + " but the pinned host budget is " +
                             FormatBytes(options.budget_bytes) +
                             "; lower the buffer count or size, or raise the host budget");
  }
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer memory, AlignedBuffer::Allocate(total));
  std::unique_ptr<StagingPool> pool(
      new StagingPool(std::move(memory), buffer_bytes, options.buffer_count));
  if (options.pin_with != nullptr && options.pin_with->CanPin()) {
    STRATA_ASSIGN_OR_RETURN(pool->pinned_region_,
                            options.pin_with->PinHostMemory(pool->memory_.data(), total));
  }
  return pool;
}

StagingBuffer StagingPool::Lend(size_t index) {
  return StagingBuffer(this, memory_.data() + index * buffer_bytes_, buffer_bytes_, index);
}

StagingBuffer StagingPool::Acquire() {
  std::unique_lock lock(mutex_);
  returned_.wait(lock, [&] { return !free_.empty(); });
  const size_t index = free_.back();
  free_.pop_back();
  return Lend(index);
}

Result<StagingBuffer> StagingPool::TryAcquire() {
  std::lock_guard lock(mutex_);
  if (free_.empty()) {
    return ResourceExhausted("staging pool: all " + std::to_string(buffer_count_) + " buffers of " +
                             FormatBytes(buffer_bytes_) + " are in use");
  }
  const size_t index = free_.back();
  free_.pop_back();
  return Lend(index);
}

size_t StagingPool::available() const {
  std::lock_guard lock(mutex_);
  return free_.size();
}

void StagingPool::Return(size_t index) {
  {
    std::lock_guard lock(mutex_);
    assert(free_.size() < buffer_count_);
    free_.push_back(index);
  }
  returned_.notify_one();
}

}  // namespace strata
