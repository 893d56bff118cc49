#include "strata/core/aligned_buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "strata/core/bytes.h"

namespace strata {

AlignedBuffer::~AlignedBuffer() { Free(); }

void AlignedBuffer::Free() {
  if (mapped_) {
    munmap(data_, size_);
  } else {
    std::free(data_);
  }
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, false)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    Free();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, false);
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

Result<AlignedBuffer> AlignedBuffer::AllocateZeroed(size_t bytes) {
  const size_t rounded = AlignUp(bytes, kHostAlignment);
  if (rounded < kMappedBytes) {
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer buffer, Allocate(bytes));
    std::memset(buffer.data(), 0, buffer.size());
    return buffer;
  }
  // Anonymous pages are zero and page-aligned, and the kernel backs each only when first
  // written.
  void* memory = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) {
    return ResourceExhausted("cannot map " + FormatBytes(rounded) +
                             " of zeroed host memory: the system is out of memory");
  }
  return AlignedBuffer(static_cast<std::byte*>(memory), rounded, /*mapped=*/true);
}

}  // namespace strata
