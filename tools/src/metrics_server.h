// MetricsServer: the live metrics endpoint of `strata train --metrics-port`.
//
// A small HTTP/1.1 server (Boost.Beast) on its own thread and io_context, so nothing it does can
// block training: GET /metrics answers the Prometheus text format (0.0.4), GET /status a JSON
// document; other paths get 404, other methods 405, and requests that do not parse 400. Each
// response is rendered by a callback on the server's thread; callbacks must be thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "strata/core/status.h"

namespace strata::tools {

struct MetricsServerOptions {
  std::string address = "127.0.0.1";            ///< Interface to listen on.
  uint16_t port = 0;                            ///< 0: a free port chosen by the system.
  std::function<std::string()> render_metrics;  ///< The /metrics body.
  std::function<std::string()> render_status;   ///< The /status body (JSON).
};

class MetricsServer {
 public:
  /// Binds and starts serving. InvalidArgument for a bad address; Unavailable (with the reason)
  /// when the port cannot be bound.
  static Result<std::unique_ptr<MetricsServer>> Start(MetricsServerOptions options);
  /// Stops accepting, drops open connections and joins the thread.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  /// The port actually bound.
  uint16_t port() const;

  class Impl;

 private:
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::tools
