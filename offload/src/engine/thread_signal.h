// ThreadSignal: a one-shot signal with a status that one thread blocks on until another opens
// it. The communicator's thread waits on these (a collective's ready function) for inputs that
// the event loop produces; the loop itself never waits on one.
#pragma once

#include <condition_variable>
#include <mutex>

#include "strata/core/status.h"

namespace strata::offload {

class ThreadSignal {
 public:
  /// Closes it again, for the next step. Nobody may be waiting.
  void Reset() {
    std::lock_guard lock(mutex_);
    open_ = false;
    status_ = Status();
  }
  /// Opens it with `status`, waking every waiter; later opens until a Reset are ignored.
  void Open(Status status) {
    std::lock_guard lock(mutex_);
    if (open_) return;
    open_ = true;
    status_ = std::move(status);
    opened_.notify_all();
  }
  /// Blocks until it is open; returns the status it was opened with. What the opener wrote
  /// before Open is visible after Wait.
  Status Wait() const {
    std::unique_lock lock(mutex_);
    opened_.wait(lock, [this] { return open_; });
    return status_;
  }

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable opened_;
  bool open_ = false;
  Status status_;
};

}  // namespace strata::offload
