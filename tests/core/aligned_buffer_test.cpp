// AlignedBuffer: aligned, owned, and with AllocateZeroed, zero — large zeroed buffers taking
// memory only where they are written.
#include "strata/core/aligned_buffer.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace strata {
namespace {

/// Pages of `buffer` the process has in memory now.
size_t ResidentPages(const AlignedBuffer& buffer) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((buffer.size() + page - 1) / page);
  EXPECT_EQ(mincore(buffer.data(), buffer.size(), resident.data()), 0);
  return size_t(std::count_if(resident.begin(), resident.end(),
                              [](unsigned char r) { return (r & 1) != 0; }));
}

TEST(AlignedBufferTest, AllocateZeroedIsZeroAlignedAndRounded) {
  for (const size_t bytes : {size_t{1}, size_t{5000}, AlignedBuffer::kMappedBytes + 1}) {
    SCOPED_TRACE(bytes);
    Result<AlignedBuffer> buffer = AlignedBuffer::AllocateZeroed(bytes);
    ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % kHostAlignment, 0u);
    EXPECT_EQ(buffer->size() % kHostAlignment, 0u);
    EXPECT_GE(buffer->size(), bytes);
    EXPECT_TRUE(std::all_of(buffer->data(), buffer->data() + buffer->size(),
                            [](std::byte b) { return b == std::byte{0}; }));
  }
}

// A large zeroed buffer is memory only where written (what a rarely used engine buffer costs).
TEST(AlignedBufferTest, ALargeZeroedBufferIsResidentOnlyWhereWritten) {
  Result<AlignedBuffer> buffer = AlignedBuffer::AllocateZeroed(size_t{16} << 20);
  ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
  EXPECT_EQ(ResidentPages(*buffer), 0u);
  buffer->data()[0] = std::byte{1};
  const size_t after_one_write = ResidentPages(*buffer);
  EXPECT_GE(after_one_write, 1u);
  EXPECT_LT(after_one_write * size_t(sysconf(_SC_PAGESIZE)), buffer->size() / 2);
}

TEST(AlignedBufferTest, MovesHandOverEitherKindOfMemory) {
  Result<AlignedBuffer> mapped = AlignedBuffer::AllocateZeroed(AlignedBuffer::kMappedBytes);
  Result<AlignedBuffer> heap = AlignedBuffer::Allocate(4096);
  ASSERT_TRUE(mapped.ok() && heap.ok());
  std::byte* mapped_data = mapped->data();
  AlignedBuffer a = std::move(*mapped);
  AlignedBuffer b = std::move(*heap);
  std::swap(a, b);  // Each frees its own kind when it goes (ASan would see a mismatch).
  EXPECT_EQ(b.data(), mapped_data);
  EXPECT_TRUE(mapped->empty());
  a = AlignedBuffer();
  EXPECT_TRUE(a.empty());
}

}  // namespace
}  // namespace strata
