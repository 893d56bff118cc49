// FaultInjectingBackend: wraps a real backend and injects faults into chosen pieces, for tests
// (like RocksDB's FaultInjectionTestFS). Rules live in a shared FaultPlan that a test may change
// between steps, e.g. to let a retry succeed after a transient fault.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "strata/nvme/io_backend.h"

namespace strata::nvme {

enum class FaultKind : int {
  kError,          ///< The piece fails with -error, without doing any I/O.
  kShortTransfer,  ///< The piece really transfers only `short_bytes`; the engine must go on.
  kDelay,          ///< The piece reaches the kernel `delay` later than asked.
  kCorruptRead,    ///< After a successful read, one bit of the data is flipped.
};

struct FaultRule {
  FaultKind kind = FaultKind::kError;
  std::optional<IoOp> op;  ///< Match only reads or only writes; any when empty.
  /// Match pieces overlapping [offset_begin, offset_end) of any file.
  uint64_t offset_begin = 0;
  uint64_t offset_end = UINT64_MAX;
  int skip = 0;   ///< Let this many matching pieces pass before firing.
  int times = 1;  ///< Fire this many times, then stop (-1: always).
  int error = EIO;
  size_t short_bytes = 4096;
  std::chrono::milliseconds delay{50};
};

/// Thread-safe set of rules, shared by a test and the backend.
class FaultPlan {
 public:
  void Add(FaultRule rule);
  void Clear();
  /// How many faults have fired so far.
  int fired() const;

  /// The rule that fires for `piece`, if any (consumes one firing).
  std::optional<FaultRule> Match(const IoPiece& piece);

 private:
  mutable std::mutex mutex_;
  struct Armed {
    FaultRule rule;
    int seen = 0;
    int fired = 0;
  };
  std::vector<Armed> rules_;
  int fired_ = 0;
};

/// Wraps `inner`; every piece is checked against `plan`.
std::unique_ptr<IoBackend> CreateFaultInjectingBackend(std::unique_ptr<IoBackend> inner,
                                                       std::shared_ptr<FaultPlan> plan);

}  // namespace strata::nvme
