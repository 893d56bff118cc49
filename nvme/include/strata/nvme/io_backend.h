// IoBackend: how pieces of requests reach the kernel. The IoEngine drives one backend from its
// I/O thread: it issues pieces, submits them, and reaps completions. Backends: io_uring, a POSIX
// thread pool, and (for tests) a fault-injecting wrapper around either.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "strata/core/status.h"
#include "strata/nvme/io_request.h"

namespace strata::nvme {

/// One piece of a request: at most the engine's block size, issued as one read or write.
/// Short transfers shrink the piece and reissue it from where it stopped.
struct IoPiece {
  IoRequest* request = nullptr;
  IoOp op = IoOp::kRead;
  int fd = -1;
  int fixed_file = -1;  ///< Index in the backend's registered files, or -1.
  uint64_t offset = 0;  ///< Absolute file offset.
  std::byte* buffer = nullptr;
  size_t length = 0;
  int registered_buffer = -1;
};

/// Called once per completed piece with the kernel's result: bytes transferred (>= 0) or -errno.
using PieceCompletion = std::function<void(IoPiece*, int64_t)>;

/// All methods except Wake() are called on the engine's I/O thread only (io_uring's single
/// issuer). Start() is called first, on that thread.
class IoBackend {
 public:
  virtual ~IoBackend() = default;

  /// "io_uring", "posix", ...
  virtual std::string name() const = 0;

  /// Prepares for up to `queue_depth` pieces in flight.
  virtual Status Start(uint32_t queue_depth) = 0;

  /// Registers buffers for fixed I/O: true when registered, false when this backend has no such
  /// thing, an error when the system refused (e.g. RLIMIT_MEMLOCK). The engine then uses plain
  /// I/O on the same buffers.
  virtual Result<bool> RegisterBuffers(std::span<const iovec> buffers) = 0;
  /// Registers an open file; returns its fixed index or -1 when not supported.
  virtual int RegisterFile(int fd) = 0;
  virtual void UnregisterFile(int fixed_index) = 0;

  /// Queues a piece; it reaches the kernel at the next Submit.
  virtual void Issue(IoPiece* piece) = 0;
  /// Submits what was issued, blocks until at least one completion or a Wake(), then reaps
  /// every available completion, calling `complete` for each. An error means the backend
  /// itself broke (not a failed piece: those are results).
  virtual Status SubmitAndWait(const PieceCompletion& complete) = 0;
  /// Thread-safe: makes a blocked SubmitAndReap return.
  virtual void Wake() = 0;
};

/// io_uring backend: SINGLE_ISSUER and DEFER_TASKRUN (or COOP_TASKRUN) when the kernel has them.
/// Unavailable (with the kernel's reason) when io_uring cannot be used here.
Result<std::unique_ptr<IoBackend>> CreateUringBackend();

/// pread/pwrite on a pool of threads; works everywhere.
std::unique_ptr<IoBackend> CreatePosixBackend(uint32_t threads);

}  // namespace strata::nvme
