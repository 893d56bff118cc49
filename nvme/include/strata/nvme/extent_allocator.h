// ExtentAllocator: first-fit allocation of aligned ranges inside one swap file, with freed
// neighbours merged so equal-sized chunks reuse space without fragmenting it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace strata::nvme {

/// Not thread-safe; SwapSpace serializes access.
class ExtentAllocator {
 public:
  /// Manages [0, capacity); every offset and length is a multiple of `alignment`.
  ExtentAllocator(uint64_t capacity, uint64_t alignment);

  /// Offset of a free range of `length` bytes (rounded up to the alignment), or nullopt.
  std::optional<uint64_t> Allocate(uint64_t length);
  /// Returns a range given out by Allocate (same length as asked then).
  void Free(uint64_t offset, uint64_t length);

  uint64_t capacity() const { return capacity_; }
  uint64_t free_bytes() const { return free_bytes_; }
  /// Largest single range that Allocate could give now.
  uint64_t largest_free() const;
  /// Number of separate free ranges (1 when nothing is fragmented).
  size_t free_ranges() const { return free_.size(); }

 private:
  uint64_t Round(uint64_t length) const {
    return (length + alignment_ - 1) / alignment_ * alignment_;
  }

  const uint64_t capacity_;
  const uint64_t alignment_;
  uint64_t free_bytes_;
  std::map<uint64_t, uint64_t> free_;  // offset -> length, no two adjacent
};

}  // namespace strata::nvme
