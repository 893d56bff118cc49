#include "sharding/reduce_ring.h"

namespace strata::offload {

Status ReduceRing::Initialize(size_t slots, size_t slot_numel, size_t quantized_bytes,
                              size_t output_numel) {
  for (size_t i = 0; i < slots; ++i) {
    Slot& slot = slots_.emplace_back();
    STRATA_ASSIGN_OR_RETURN(slot.buffer, AlignedBuffer::Allocate(slot_numel * sizeof(float)));
    if (quantized_bytes > 0) {
      STRATA_ASSIGN_OR_RETURN(slot.sent, AlignedBuffer::Allocate(quantized_bytes));
      STRATA_ASSIGN_OR_RETURN(slot.received, AlignedBuffer::Allocate(quantized_bytes));
    }
    if (output_numel > 0) {
      STRATA_ASSIGN_OR_RETURN(slot.output, AlignedBuffer::Allocate(output_numel * sizeof(float)));
    }
    slot.turn = i;
  }
  return Status();
}

Awaitable<void> ReduceRing::WaitTurn(uint64_t number) {
  return boost::asio::async_initiate<const boost::asio::use_awaitable_t<>, void()>(
      [this, number](auto handler) {
        auto resume = internal::PostingCallback(std::move(handler));
        if (slots_[number % slots_.size()].turn == number) {
          resume();
        } else {
          waiting_.emplace(number, std::move(resume));
        }
      },
      boost::asio::use_awaitable);
}

void ReduceRing::MarkFilled(uint64_t number) {
  {
    std::lock_guard lock(filled_mutex_);
    SlotOf(number).filled_end = number + 1;
  }
  filled_.notify_all();
}

Status ReduceRing::WaitFilled(uint64_t number) {
  std::unique_lock lock(filled_mutex_);
  // A later number of the same slot cannot be written before this one's collective has read it.
  filled_.wait(lock, [&] { return SlotOf(number).filled_end > number; });
  return Status();
}

void ReduceRing::Release(uint64_t number) {
  if (++releases_[number] < 2) return;
  releases_.erase(number);
  const uint64_t next = number + slots_.size();
  slots_[number % slots_.size()].turn = next;
  if (auto it = waiting_.find(next); it != waiting_.end()) {
    auto resume = std::move(it->second);
    waiting_.erase(it);
    resume();
  }
}

}  // namespace strata::offload
