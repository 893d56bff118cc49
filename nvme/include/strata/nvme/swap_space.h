// SwapSpace: where offloaded state lives on NVMe.
//
// One preallocated file per nvme path per engine, so running out of space is found when the
// space is reserved, not in the middle of a step. Extents are allocated inside those files; an
// extent of at least stripe_bytes is split across every path so several devices add their
// bandwidth. Every write records an XXH3-64 checksum of the data; a read whose data does not
// match returns DataLoss naming the extent, never silently wrong bytes.
//
// Swap files are scratch: removed when the SwapSpace is destroyed. Files left by a crashed run
// (their process is gone) are detected at creation and removed, never trusted: only regular
// files named exactly "strata-swap-<pid>-<n>.bin" that start with the header block every swap
// file has (its first extent starts after it); anything else of a similar name is left.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"
#include "strata/nvme/io_engine.h"

namespace strata::nvme {

/// The owner's pid in a swap file's name, "strata-swap-<pid>-<n>.bin" (both decimal), or 0 when
/// `name` is not exactly of that form.
pid_t SwapFilePid(std::string_view name);

struct SwapSpaceOptions {
  /// Directories on the NVMe devices (DeepSpeed's nvme_path). At least one.
  std::vector<std::string> paths;
  /// Bytes reserved in each path's swap file.
  uint64_t bytes_per_path = 0;
  /// Extents at least this large are split across all paths; smaller ones stay on one path.
  uint64_t stripe_bytes = uint64_t{4} << 20;
  bool direct_io = true;
  bool allow_buffered_fallback = false;
  /// XXH3-64 of every extent written, verified on read. Off only for benchmarks.
  bool checksums = true;

  Status Validate() const;
};

struct ExtentId {
  uint32_t index = UINT32_MAX;
  bool valid() const { return index != UINT32_MAX; }
};

/// Thread-safe. I/O completion callbacks run on the IoEngine's I/O thread.
class SwapSpace {
 public:
  /// Creates and reserves the swap files, registering them with `engine`, which must outlive
  /// the SwapSpace.
  static Result<std::unique_ptr<SwapSpace>> Create(SwapSpaceOptions options, IoEngine& engine);
  /// Unregisters, closes and removes the swap files. No I/O may be in flight.
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  /// Reserves room for `bytes`. ResourceExhausted with the amount asked and the amount free.
  Result<ExtentId> Allocate(uint64_t bytes);
  void Free(ExtentId extent);

  /// Writes `bytes` from `data` into `extent` (bytes <= the extent's size). `data` must be
  /// aligned to alignment() and hold AlignUp(bytes, alignment()) bytes; the tail beyond
  /// `bytes` is written as is. `done` runs once with the result. `checksum`, when given, is
  /// Checksum(data, bytes) computed by the caller (say, on a worker thread, so that an event
  /// loop submitting the write does not hash); otherwise Write hashes on the calling thread.
  void Write(ExtentId extent, const std::byte* data, size_t bytes, int registered_buffer,
             std::function<void(Status)> done, std::optional<uint64_t> checksum = std::nullopt);
  /// What Write records for `bytes` at `data`: their XXH3, or 0 when checksums are off.
  uint64_t Checksum(const std::byte* data, size_t bytes) const;
  /// Reads back what the last Write stored (its `bytes`) into `data`, verifying the checksum.
  void Read(ExtentId extent, std::byte* data, int registered_buffer,
            std::function<void(Status)> done);

  /// Blocking forms of Write and Read.
  Status WriteSync(ExtentId extent, const std::byte* data, size_t bytes,
                   int registered_buffer = -1);
  Status ReadSync(ExtentId extent, std::byte* data, int registered_buffer = -1);

  /// Bytes the last write stored in `extent` (0 when never written).
  uint64_t stored_bytes(ExtentId extent) const;
  /// Checksum of the last write (0 when never written or checksums are off).
  uint64_t checksum(ExtentId extent) const;
  /// "extent 3 (64MiB in /nvme0/strata-swap-123-0.bin at 1048576, /nvme1/...)".
  std::string Describe(ExtentId extent) const;

  uint32_t alignment() const;
  uint64_t capacity_bytes() const;
  uint64_t free_bytes() const;
  std::vector<std::string> file_paths() const;

  class Impl;

 private:
  explicit SwapSpace(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::nvme
