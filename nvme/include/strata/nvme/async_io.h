// Awaiting NVMe I/O from a coroutine on the async spine.
//
//   Status s = co_await AwaitIo(engine, request);             // one IoRequest
//   s = co_await AwaitSwapWrite(swap, extent, data, bytes);    // a whole extent
//
// The engine's I/O thread posts each completion to the awaiting coroutine's executor; Asio
// wakes its event loop through its eventfd, so the loop never blocks on I/O.
#pragma once

#include "strata/core/event_loop.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_space.h"

namespace strata::nvme {

/// Submits `request` (its on_complete is replaced) and resumes with its status. The request
/// and its buffer must stay alive until then.
inline Awaitable<Status> AwaitIo(IoEngine& engine, IoRequest& request) {
  return boost::asio::async_initiate<const boost::asio::use_awaitable_t<>, void(Status)>(
      [&engine, &request](auto handler) {
        auto callback = internal::PostingCallback(std::move(handler));
        request.on_complete = [callback](IoRequest& done) { callback(done.status); };
        engine.Submit(&request);
      },
      boost::asio::use_awaitable);
}

/// SwapSpace::Write, awaited. Pass `checksum` (SwapSpace::Checksum of the data, computed off the
/// loop) so that the loop thread does not hash.
inline Awaitable<Status> AwaitSwapWrite(SwapSpace& swap, ExtentId extent, const std::byte* data,
                                        size_t bytes, int registered_buffer = -1,
                                        std::optional<uint64_t> checksum = std::nullopt) {
  return boost::asio::async_initiate<const boost::asio::use_awaitable_t<>, void(Status)>(
      [&swap, extent, data, bytes, registered_buffer, checksum](auto handler) {
        auto callback = internal::PostingCallback(std::move(handler));
        swap.Write(
            extent, data, bytes, registered_buffer,
            [callback](Status status) { callback(std::move(status)); }, checksum);
      },
      boost::asio::use_awaitable);
}

/// SwapSpace::Read (checksum verified), awaited.
inline Awaitable<Status> AwaitSwapRead(SwapSpace& swap, ExtentId extent, std::byte* data,
                                       int registered_buffer = -1) {
  return boost::asio::async_initiate<const boost::asio::use_awaitable_t<>, void(Status)>(
      [&swap, extent, data, registered_buffer](auto handler) {
        auto callback = internal::PostingCallback(std::move(handler));
        swap.Read(extent, data, registered_buffer,
                  [callback](Status status) { callback(std::move(status)); });
      },
      boost::asio::use_awaitable);
}

}  // namespace strata::nvme
