#include "strata/core/event_loop.h"

#include <pthread.h>

namespace strata {

EventLoop::EventLoop() : work_(boost::asio::make_work_guard(context_)) {
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "strata-loop");
    context_.run();
  });
}

EventLoop::~EventLoop() {
  work_.reset();
  context_.stop();
  thread_.join();
}

Awaitable<Status> AwaitReadable(int fd) {
  auto executor = co_await boost::asio::this_coro::executor;
  boost::asio::posix::stream_descriptor descriptor(executor);
  boost::system::error_code error;
  descriptor.assign(fd, error);  // The error_code overload: Strata does not use exceptions.
  if (error) {
    co_return IoError("cannot wait for fd " + std::to_string(fd) + ": " + error.message());
  }
  co_await descriptor.async_wait(boost::asio::posix::descriptor_base::wait_read,
                                 boost::asio::redirect_error(boost::asio::use_awaitable, error));
  descriptor.release();  // The caller keeps owning the fd.
  if (error) {
    co_return IoError("waiting for fd " + std::to_string(fd) +
                      " to become readable: " + error.message());
  }
  co_return Status();
}

}  // namespace strata
