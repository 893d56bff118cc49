#include "engine/loop_sync.h"

namespace strata::offload {

Awaitable<void> LoopSemaphore::Acquire() {
  return boost::asio::async_initiate<const boost::asio::use_awaitable_t<>, void()>(
      [this](auto handler) {
        auto resume = internal::PostingCallback(std::move(handler));
        if (count_ > 0) {
          --count_;
          resume();
        } else {
          waiters_.emplace_back(std::move(resume));
        }
      },
      boost::asio::use_awaitable);
}

void LoopSemaphore::Release() {
  if (waiters_.empty()) {
    ++count_;
    return;
  }
  auto next = std::move(waiters_.front());
  waiters_.pop_front();
  next();
}

Awaitable<StagingBuffer> LoopStagingPool::Acquire() {
  co_await free_.Acquire();
  // A unit of free_ is a free buffer, so this cannot fail.
  co_return std::move(pool_->TryAcquire()).value();
}

void LoopStagingPool::Release(StagingBuffer& buffer) {
  if (!buffer.valid()) return;
  buffer.Reset();
  free_.Release();
}

Awaitable<void> LoopLatch::Wait() {
  return boost::asio::async_initiate<const boost::asio::use_awaitable_t<>, void()>(
      [this](auto handler) {
        auto resume = internal::PostingCallback(std::move(handler));
        if (open_) {
          resume();
        } else {
          waiters_.emplace_back(std::move(resume));
        }
      },
      boost::asio::use_awaitable);
}

void LoopLatch::Open() {
  open_ = true;
  while (!waiters_.empty()) {
    auto next = std::move(waiters_.front());
    waiters_.pop_front();
    next();
  }
}

}  // namespace strata::offload
