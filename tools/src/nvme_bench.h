// The measurement behind `strata bench nvme` (and the NVMe sweep of `strata bench all`):
// sequential O_DIRECT passes through the IoEngine, like fio's sequential jobs: block_size reads
// or writes, queue_depth of them in flight.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/nvme/io_request.h"

namespace strata::tools {

struct NvmeBenchSettings {
  std::string path;  ///< Directory measured.
  std::string file;  ///< Empty: a scratch file in `path`, removed afterwards.
  uint64_t block_size = 1 << 20;
  uint32_t queue_depth = 32;
  uint64_t size = uint64_t{4} << 30;  ///< Bytes per pass.
  NvmeBackend backend = NvmeBackend::kAuto;
  bool progress = true;  ///< A live line on stderr while a pass runs.
};

struct NvmePass {
  nvme::IoOp op;
  uint64_t block_size;
  uint32_t queue_depth;
  uint64_t bytes;
  double seconds;
  std::string backend;
  double bytes_per_second() const { return seconds > 0 ? bytes / seconds : 0; }
};

/// Runs the asked passes, "read", "write" or "both" (write first), over one file. A new file is
/// first laid out by an unmeasured write pass. Errors: whatever creating, sizing or accessing
/// the file reports (a missing directory is NotFound, a full one ResourceExhausted).
Result<std::vector<NvmePass>> RunNvmeBench(const NvmeBenchSettings& settings,
                                           const std::string& rw);

/// {"rw", "block_size", "queue_depth", "bytes", "seconds", "bytes_per_second", "backend"}.
nlohmann::ordered_json ToJson(const NvmePass& pass);

}  // namespace strata::tools
