// The POSIX backend: pread/pwrite on a pool of threads. Slower than io_uring, but works
// wherever files do (old kernels, io_uring disabled by sysctl or seccomp).
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "strata/nvme/io_backend.h"

namespace strata::nvme {
namespace {

class PosixBackend final : public IoBackend {
 public:
  explicit PosixBackend(uint32_t threads) : thread_count_(threads == 0 ? 1 : threads) {}

  ~PosixBackend() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (auto& thread : threads_) thread.join();
  }

  std::string name() const override { return "posix"; }

  Status Start(uint32_t /*queue_depth*/) override {
    for (uint32_t i = 0; i < thread_count_; ++i) threads_.emplace_back([this] { Work(); });
    return Status();
  }

  Result<bool> RegisterBuffers(std::span<const iovec>) override { return false; }
  int RegisterFile(int) override { return -1; }
  void UnregisterFile(int) override {}

  void Issue(IoPiece* piece) override { issued_.push_back(piece); }

  Status SubmitAndWait(const PieceCompletion& complete) override {
    std::vector<std::pair<IoPiece*, int64_t>> done;
    {
      std::unique_lock lock(mutex_);
      for (IoPiece* piece : issued_) work_.push_back(piece);
      if (!issued_.empty()) work_ready_.notify_all();
      issued_.clear();
      completed_cv_.wait(lock, [&] { return woken_ || !completed_.empty(); });
      woken_ = false;
      done.swap(completed_);
    }
    for (auto& [piece, result] : done) complete(piece, result);
    return Status();
  }

  void Wake() override {
    {
      std::lock_guard lock(mutex_);
      woken_ = true;
    }
    completed_cv_.notify_one();
  }

 private:
  void Work() {
    std::unique_lock lock(mutex_);
    for (;;) {
      work_ready_.wait(lock, [&] { return stopping_ || !work_.empty(); });
      if (work_.empty()) return;
      IoPiece* piece = work_.front();
      work_.pop_front();
      lock.unlock();
      const ssize_t n =
          piece->op == IoOp::kRead
              ? pread(piece->fd, piece->buffer, piece->length, static_cast<off_t>(piece->offset))
              : pwrite(piece->fd, piece->buffer, piece->length, static_cast<off_t>(piece->offset));
      const int64_t result = n < 0 ? -static_cast<int64_t>(errno) : n;
      lock.lock();
      completed_.emplace_back(piece, result);
      completed_cv_.notify_one();
    }
  }

  const uint32_t thread_count_;
  std::vector<IoPiece*> issued_;  // I/O thread only.
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable completed_cv_;
  std::deque<IoPiece*> work_;
  std::vector<std::pair<IoPiece*, int64_t>> completed_;
  bool woken_ = false;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<IoBackend> CreatePosixBackend(uint32_t threads) {
  return std::make_unique<PosixBackend>(threads);
}

}  // namespace strata::nvme
