// IoRequest: one transfer between a file and host memory, and the pieces it is split into.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "strata/core/status.h"

namespace strata::nvme {

enum class IoOp : int { kRead = 0, kWrite = 1 };

/// "read" or "write".
const char* IoOpName(IoOp op);

/// A file known to an IoEngine (see IoEngine::RegisterFile).
struct FileId {
  int index = -1;
  bool valid() const { return index >= 0; }
  friend bool operator==(FileId a, FileId b) = default;
};

/// One contiguous transfer. The caller fills the inputs, keeps the request and its buffer alive
/// and untouched until `on_complete` has run, and reads the results there or after.
/// Like RocksDB's FSReadRequest, the request carries its own status and byte count.
struct IoRequest {
  // Inputs.
  IoOp op = IoOp::kRead;
  FileId file;
  uint64_t offset = 0;          ///< Aligned to the file's O_DIRECT alignment when it is direct.
  size_t length = 0;            ///< Likewise; need not be a multiple of the engine's block size.
  std::byte* buffer = nullptr;  ///< Aligned host memory of at least `length` bytes.
  /// Index of a buffer registered with IoEngine::RegisterBuffers that contains
  /// [buffer, buffer + length), or -1. Registered buffers skip page pinning on every I/O.
  int registered_buffer = -1;
  /// Called exactly once, on the engine's I/O thread, when every piece is done or the request
  /// failed. Keep it short (post the result somewhere); it must not block.
  std::function<void(IoRequest&)> on_complete;

  // Results, valid in and after on_complete.
  Status status;
  size_t bytes_done = 0;  ///< Bytes transferred; equals `length` when status is OK.

  // Engine bookkeeping; not for callers.
  int fd_ = -1;
  int fixed_file_ = -1;
  uint64_t next_offset_ = 0;  ///< Relative offset of the next piece to issue.
  uint32_t pieces_in_flight_ = 0;
  bool failed_ = false;
};

}  // namespace strata::nvme
