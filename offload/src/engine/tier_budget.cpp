#include "strata/offload/tier_budget.h"

#include <algorithm>
#include <cassert>

#include "strata/core/bytes.h"

namespace strata::offload {

bool TierBudget::TryReserve(uint64_t bytes) {
  std::lock_guard lock(mutex_);
  if (bytes > budget_ - used_) return false;
  used_ += bytes;
  peak_ = std::max(peak_, used_);
  return true;
}

Status TierBudget::Reserve(uint64_t bytes, const std::string& purpose) {
  if (TryReserve(bytes)) return Status();
  const TierUsage u = usage();
  return ResourceExhausted(std::string(TierName(tier_)) + " memory budget of " +
                           FormatBytes(u.budget_bytes) + " cannot hold " + purpose + " (" +
                           FormatBytes(bytes) + "; " + FormatBytes(u.used_bytes) +
                           " already in use)");
}

void TierBudget::SetBudget(uint64_t budget_bytes) {
  std::lock_guard lock(mutex_);
  budget_ = budget_bytes;
}

void TierBudget::Release(uint64_t bytes) {
  std::lock_guard lock(mutex_);
  assert(bytes <= used_);
  used_ -= std::min(bytes, used_);
}

TierUsage TierBudget::usage() const {
  std::lock_guard lock(mutex_);
  return {budget_, used_, peak_};
}

uint64_t TierBudget::free_bytes() const {
  std::lock_guard lock(mutex_);
  return budget_ - used_;
}

}  // namespace strata::offload
