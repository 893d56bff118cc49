#include "strata/core/aligned_buffer.h"

#include <cstdlib>
#include <new>
#include <utility>

#include "strata/core/bytes.h"

namespace strata {

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Result<AlignedBuffer> AlignedBuffer::Allocate(size_t bytes) {
  if (bytes == 0) return AlignedBuffer();
  const size_t rounded = AlignUp(bytes, kHostAlignment);
  void* memory = std::aligned_alloc(kHostAlignment, rounded);
  if (memory == nullptr) {
    return ResourceExhausted("cannot allocate " + FormatBytes(rounded) +
                             " of aligned host memory: the system is out of memory");
  }
  return AlignedBuffer(static_cast<std::byte*>(memory), rounded);
}

}  // namespace strata
