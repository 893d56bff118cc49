// TierBudget: byte accounting for one memory tier, with a high-water mark.
//
// The engine reserves from a tier's budget before it allocates there and releases after it
// frees, so a budget is never exceeded: a reservation that does not fit fails and the caller
// evicts, waits or reports the error. Tests read peak() to check exactly that.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "strata/core/status.h"
#include "strata/core/tier.h"

namespace strata::offload {

/// What a tier has and uses, for metrics, tests and the summary of a run.
struct TierUsage {
  uint64_t budget_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t peak_bytes = 0;  ///< High-water mark of used_bytes.
};

/// Thread-safe.
class TierBudget {
 public:
  TierBudget(Tier tier, uint64_t budget_bytes) : tier_(tier), budget_(budget_bytes) {}

  /// Takes `bytes` if they fit; false (nothing taken) if not.
  bool TryReserve(uint64_t bytes);
  /// Takes `bytes` or fails with ResourceExhausted naming the tier, what `purpose` needed, the
  /// budget and what is in use.
  Status Reserve(uint64_t bytes, const std::string& purpose);
  /// Changes the budget (set-up only: before anything is reserved beyond it).
  void SetBudget(uint64_t budget_bytes);
  /// Gives back bytes taken earlier.
  void Release(uint64_t bytes);

  TierUsage usage() const;
  uint64_t free_bytes() const;
  Tier tier() const { return tier_; }

 private:
  const Tier tier_;
  mutable std::mutex mutex_;
  uint64_t budget_;
  uint64_t used_ = 0;
  uint64_t peak_ = 0;
};

/// A reservation that gives its bytes back when destroyed. Move-only.
class BudgetReservation {
 public:
  BudgetReservation() = default;
  BudgetReservation(TierBudget* budget, uint64_t bytes) : budget_(budget), bytes_(bytes) {}
  ~BudgetReservation() { Reset(); }
  BudgetReservation(BudgetReservation&& other) noexcept { *this = std::move(other); }
  BudgetReservation& operator=(BudgetReservation&& other) noexcept {
    if (this != &other) {
      Reset();
      budget_ = other.budget_;
      bytes_ = other.bytes_;
      other.budget_ = nullptr;
      other.bytes_ = 0;
    }
    return *this;
  }
  BudgetReservation(const BudgetReservation&) = delete;
  BudgetReservation& operator=(const BudgetReservation&) = delete;

  void Reset() {
    if (budget_ != nullptr) budget_->Release(bytes_);
    budget_ = nullptr;
    bytes_ = 0;
  }
  uint64_t bytes() const { return bytes_; }

 private:
  TierBudget* budget_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace strata::offload
