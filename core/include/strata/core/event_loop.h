// The async spine: one Boost.Asio io_context run by an engine-owned thread, where every
// completion lands. A chunk's journey is one coroutine that awaits device work, jobs and file
// descriptors (io_uring's eventfd) in turn:
//
//   Status s = co_await AwaitStream(device, Stream::kDeviceToHost);   // D2H copies done
//   auto norm_job = [&grads] { return SumOfSquares(grads); };
//   float norm = co_await AwaitJob(job_threads, std::move(norm_job));
//   s = co_await AwaitReadable(ring_eventfd);
//
// Blocking work never runs on the loop thread: device completions arrive from the device's
// threads, jobs run on JobThreads, and each only posts its result to the loop.
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <type_traits>

#include "strata/core/asio.h"
#include "strata/core/device.h"
#include "strata/core/status.h"

namespace strata {

template <typename T>
using Awaitable = boost::asio::awaitable<T>;

/// Owns an io_context and the thread that runs it. Destruction stops the loop and joins the
/// thread; coroutines still suspended are destroyed without resuming. Thread-safe.
class EventLoop {
 public:
  EventLoop();
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  boost::asio::io_context& context() { return context_; }
  boost::asio::any_io_executor executor() { return context_.get_executor(); }
  /// True on the loop's own thread.
  bool InLoopThread() const { return std::this_thread::get_id() == thread_.get_id(); }

  /// Starts `coroutine` on the loop and blocks the calling thread until it finishes, returning
  /// its value. Must not be called from the loop thread (it would deadlock).
  template <typename T>
  T Run(Awaitable<T> coroutine) {
    return boost::asio::co_spawn(context_, std::move(coroutine), boost::asio::use_future).get();
  }

 private:
  boost::asio::io_context context_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  std::thread thread_;
};

namespace internal {

/// Wraps a (move-only) completion handler so a copyable std::function can carry it, and
/// delivers the result on the handler's own executor.
template <typename Handler>
auto PostingCallback(Handler&& handler) {
  auto shared = std::make_shared<std::decay_t<Handler>>(std::forward<Handler>(handler));
  return [shared](auto... results) {
    auto executor = boost::asio::get_associated_executor(*shared);
    boost::asio::post(executor,
                      [shared, results...]() mutable { (*shared)(std::move(results)...); });
  };
}

/// void(R), or void() for jobs that return nothing.
template <typename R>
struct CompletionSignature {
  using type = void(R);
};
template <>
struct CompletionSignature<void> {
  using type = void();
};

}  // namespace internal

/// Completes when all work queued on `stream` before the call has run. The Status is not OK
/// only when the device refused to queue the notification.
inline Awaitable<Status> AwaitStream(Device& device, Stream stream) {
  return boost::asio::async_initiate<const boost::asio::use_awaitable_t<>, void(Status)>(
      [&device, stream](auto handler) {
        auto callback = internal::PostingCallback(std::move(handler));
        Status queued = device.LaunchHostFunction(stream, [callback] { callback(Status()); });
        if (!queued.ok()) callback(std::move(queued));
      },
      boost::asio::use_awaitable);
}

/// Counts jobs started by AwaitJob that have not finished, the post of their result included,
/// so that an owner can wait for them before the loop they post to is destroyed (a post racing
/// the destruction of its io_context is undefined behaviour).
class JobCounter {
 public:
  void Started() { count_.fetch_add(1); }
  void Finished() {
    if (count_.fetch_sub(1) == 1) count_.notify_all();
  }
  /// Blocks until every job started so far has finished.
  void WaitForAll() const {
    for (size_t n = count_.load(); n != 0; n = count_.load()) count_.wait(n);
  }

 private:
  std::atomic<size_t> count_{0};
};

/// The threads that run AwaitJob's blocking jobs (optimizer steps, gradient sums, checksums).
/// Plain threads, not oneTBB workers: a job that runs a parallel loop in a oneTBB arena of its
/// own (CpuOptimizer's) joins that arena as one more thread. From a oneTBB worker it would
/// instead take one of the workers its parallel loop needs, of which oneTBB makes one fewer than
/// there are cores: on two cores, that loop would run on the job's thread alone. Destruction
/// runs the jobs already posted, then joins.
class JobThreads {
 public:
  explicit JobThreads(int threads) : pool_(size_t(std::max(1, threads))) {}
  ~JobThreads() { pool_.join(); }
  JobThreads(const JobThreads&) = delete;
  JobThreads& operator=(const JobThreads&) = delete;

  /// Runs `work` on one of the threads.
  template <typename Work>
  void Post(Work&& work) {
    boost::asio::post(pool_, std::forward<Work>(work));
  }

 private:
  boost::asio::thread_pool pool_;
};

/// Runs `job` on `threads` (never the loop thread) and resumes with its result. `job` must not
/// block on I/O or on the loop. `counter`, when given, counts the job until its thread is done
/// with it.
///
/// GCC 12 hazard: a lambda with non-trivially destructible captures written inline in a
/// co_await expression is destroyed twice (a compiler bug; a shared_ptr capture then frees
/// early). Name the job first: `auto job = [state] {...}; co_await AwaitJob(threads,
/// std::move(job));`. Lambdas capturing only references or trivial values are unaffected.
template <typename Job, typename R = std::invoke_result_t<Job&>>
Awaitable<R> AwaitJob(JobThreads& threads, Job job, JobCounter* counter = nullptr) {
  using Signature = typename internal::CompletionSignature<R>::type;
  return boost::asio::async_initiate<const boost::asio::use_awaitable_t<>, Signature>(
      [&threads, counter, job = std::move(job)](auto handler) mutable {
        auto callback = internal::PostingCallback(std::move(handler));
        if (counter != nullptr) counter->Started();
        // Posted work must be copyable; the job itself may be stateful and move-only.
        threads.Post([job = std::make_shared<Job>(std::move(job)), callback, counter] {
          if constexpr (std::is_void_v<R>) {
            (*job)();
            callback();
          } else {
            callback((*job)());
          }
          if (counter != nullptr) counter->Finished();
        });
      },
      boost::asio::use_awaitable);
}

/// Completes when `fd` becomes readable (e.g. an eventfd signalled by io_uring). The fd stays
/// owned by the caller. IoError when the wait fails.
Awaitable<Status> AwaitReadable(int fd);

}  // namespace strata
