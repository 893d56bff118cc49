// IoEngine: asynchronous file I/O for the NVMe tier.
//
// A request (file, offset, length, buffer) is split into block_size pieces kept up to
// queue_depth in flight. Short transfers continue from where they stopped; EINTR and EAGAIN
// are retried here and nowhere else; a failed piece fails its whole request with a Status
// naming the path, offset, length and errno text. A request completes once, when every piece is
// done, by calling its on_complete on the engine's I/O thread.
//
// The engine owns one I/O thread that owns the backend (io_uring's single issuer). io_uring is
// used when it works here; otherwise a POSIX pread/pwrite pool takes over and says so once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "strata/core/options.h"  // NvmeBackend
#include "strata/core/status.h"
#include "strata/nvme/io_backend.h"
#include "strata/nvme/io_request.h"

namespace strata::nvme {

struct IoEngineOptions {
  /// auto: io_uring when it works here, else POSIX (with one log line saying why).
  NvmeBackend backend = NvmeBackend::kAuto;
  /// Largest single read or write; requests are split into pieces of this size (DeepSpeed's
  /// aio.block_size). A multiple of 4 KiB.
  uint64_t block_size = uint64_t{1} << 20;
  /// Pieces in flight at once (DeepSpeed's aio.queue_depth).
  uint32_t queue_depth = 32;
  /// Threads of the POSIX backend; 0 = queue_depth, at most 64.
  uint32_t posix_threads = 0;
  /// Tests: wraps the chosen backend (e.g. in a FaultInjectingBackend).
  std::function<std::unique_ptr<IoBackend>(std::unique_ptr<IoBackend>)> wrap_backend;

  Status Validate() const;
};

/// Thread-safe: any thread may register files and submit requests.
class IoEngine {
 public:
  static Result<std::unique_ptr<IoEngine>> Create(IoEngineOptions options);
  /// Waits for every submitted request to complete, then stops the I/O thread.
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  /// The backend in use: "io_uring", "posix", or a wrapper's name.
  const std::string& backend_name() const;
  const IoEngineOptions& options() const;

  /// Makes an open file known to the engine. The fd stays owned by the caller and must stay
  /// open until UnregisterFile. `path` is used in error messages.
  Result<FileId> RegisterFile(int fd, std::string path);
  void UnregisterFile(FileId file);

  /// Registers equal buffers (e.g. a StagingPool's arena split into its buffers) for fixed
  /// I/O. Returns true when registered; false when the backend or the system refused, in
  /// which case one log line says why and plain I/O is used on the same buffers. Either way
  /// the whole huge pages inside `arena` are first moved onto transparent huge pages (best
  /// effort; see BackWithHugePages in io_engine.cpp): a 2MiB-aligned arena gets the most.
  bool RegisterBuffers(std::span<std::byte> arena, size_t buffer_bytes);

  /// Starts `request`; its on_complete runs on the I/O thread. Invalid requests (unknown file,
  /// null buffer, zero length) complete at once with InvalidArgument.
  void Submit(IoRequest* request);

  /// Submits and blocks until `request` completes; returns its status.
  Status Execute(IoRequest& request);

  class Impl;

 private:
  explicit IoEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::nvme
