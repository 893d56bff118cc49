// Communicator: the collectives the engine needs across data-parallel ranks.
//
// The engine reduces two things across ranks every step: the gradients of each chunk (summed,
// then each rank updates its shard) and the step's global facts (sum of squares for gradient
// clipping, whether any rank overflowed). This interface says exactly that much, so a
// single-process run needs no NCCL and the NCCL implementation (with the multi-rank issue) can
// drop in. Rank sharding of chunks is not implemented yet: with more than one rank, Engine::Create
// refuses the communicator with Unavailable.
#pragma once

#include <memory>
#include <span>

#include "strata/core/status.h"

namespace strata::offload {

/// Thread safety: implementations are called from the engine's loop thread only, one collective
/// at a time, in the same order on every rank.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Element-wise sum of `values` over all ranks, in place.
  virtual Status AllReduceSum(std::span<double> values) = 0;
};

/// The only rank: every collective is the identity.
std::unique_ptr<Communicator> CreateSingleRankCommunicator();

}  // namespace strata::offload
