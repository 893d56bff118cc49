// What the metrics endpoint serves, as callbacks: shared by the server (metrics_server.h) and
// its request handling (metrics_http.h) without pulling Beast into the callers.
#pragma once

#include <functional>
#include <string>

namespace strata::tools {

/// The /metrics and /status bodies, rendered on the server's thread for each request: each must
/// be thread-safe.
struct MetricsHandlers {
  std::function<std::string()> render_metrics;  ///< Prometheus text format 0.0.4.
  std::function<std::string()> render_status;   ///< JSON.
};

}  // namespace strata::tools
