#include "strata/nvme/extent_allocator.h"

#include <algorithm>
#include <cassert>

namespace strata::nvme {

ExtentAllocator::ExtentAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity / alignment * alignment), alignment_(alignment), free_bytes_(capacity_) {
  if (capacity_ > 0) free_[0] = capacity_;
}

std::optional<uint64_t> ExtentAllocator::Allocate(uint64_t length) {
  const uint64_t size = Round(length == 0 ? 1 : length);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    const uint64_t offset = it->first;
    const uint64_t remaining = it->second - size;
    free_.erase(it);
    if (remaining > 0) free_[offset + size] = remaining;
    free_bytes_ -= size;
    return offset;
  }
  return std::nullopt;
}

void ExtentAllocator::Free(uint64_t offset, uint64_t length) {
  uint64_t size = Round(length == 0 ? 1 : length);
  assert(offset + size <= capacity_);
  free_bytes_ += size;
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + size == next->first) {  // Merge with the range after.
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // Merge with the range before.
    auto previous = std::prev(next);
    if (previous->first + previous->second == offset) {
      previous->second += size;
      return;
    }
  }
  free_[offset] = size;
}

uint64_t ExtentAllocator::largest_free() const {
  uint64_t largest = 0;
  for (const auto& [offset, length] : free_) largest = std::max(largest, length);
  return largest;
}

}  // namespace strata::nvme
