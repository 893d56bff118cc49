// MetricsServer: the live metrics endpoint of `strata train --metrics-port`.
//
// A small HTTP/1.1 server (Boost.Beast) on its own thread and io_context, so nothing it does can
// block training; what it answers is metrics_http.h's. It holds up under load and abuse:
//  - at most max_connections are open; a new one beyond that closes one that is lingering after
//    its last answer, else the one that has waited longest (for a request to arrive or for its
//    client to read a response), so idle or trickling connections (a slowloris) cannot lock out
//    a scraper;
//  - a request must arrive in full within request_timeout of the previous answer (or of the
//    connect), and a response be taken within the same time, or the connection is closed;
//  - requests are bounded in size (metrics_http.h) and pipelined ones answered in order;
//  - answers are paced: after a burst of request_burst, at most max_requests_per_second (a
//    Prometheus scrape is one every 15 s, a dashboard one a second), and a request beyond that
//    waits its turn, so a flood costs training what that rate costs however fast it comes (CPU
//    priority alone cannot promise that where cores are hyper-threads of one another or a host
//    caps the machine's CPU time: a CI machine measured a 1.30x step under wrk without pacing);
//  - the thread runs at a lower CPU priority (nice +10) than training, so what answering still
//    costs comes from what training leaves.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "metrics_handlers.h"
#include "strata/core/status.h"

namespace strata::tools {

struct MetricsServerOptions {
  std::string address = "127.0.0.1";  ///< Interface to listen on; loopback unless asked.
  uint16_t port = 0;                  ///< 0: a free port chosen by the system.
  MetricsHandlers handlers;           ///< What it serves.
  size_t max_connections = 64;
  std::chrono::milliseconds request_timeout{10'000};
  double max_requests_per_second = 100;  ///< Answers a second once a burst is spent; > 0.
  size_t request_burst = 100;            ///< Answered at once after a quiet spell; >= 1.
};

class MetricsServer {
 public:
  /// Binds and starts serving. InvalidArgument for a bad address or limits; Unavailable (with
  /// the reason) when the port cannot be bound.
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
