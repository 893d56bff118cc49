// MetricsServer over loopback sockets: connections are bounded and the longest-waiting one
// gives way, trickling requests time out, pipelined requests and oversized input are handled
// as metrics_http_test.cpp checks without sockets.
#include "metrics_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "metrics_http.h"

namespace strata::tools {
namespace {

using namespace std::chrono_literals;

/// A client socket to the server on loopback, closed when it goes.
class Client {
 public:
  explicit Client(uint16_t port) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  }
  ~Client() { close(fd_); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  bool connected() const { return connected_; }

  bool Send(const std::string& bytes) {
    for (size_t sent = 0; sent < bytes.size();) {
      const ssize_t n = send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += size_t(n);
    }
    return true;
  }

  /// What arrives until the server closes the connection or `within` passes; `closed()` tells
  /// which.
  std::string Receive(std::chrono::milliseconds within) {
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + within;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left <= 0ms) return out;
      pollfd p{.fd = fd_, .events = POLLIN, .revents = 0};
      if (poll(&p, 1, int(left.count())) <= 0) return out;
      char chunk[4096];
      const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
      if (n <= 0) {
        closed_ = true;
        return out;
      }
      out.append(chunk, size_t(n));
    }
  }

  /// Reads until `count` responses have arrived whole (by Content-Length) or `within` passes.
  std::string ReceiveResponses(size_t count, std::chrono::milliseconds within) {
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + within;
    while (CompleteResponses(out) < count && !closed_ &&
           std::chrono::steady_clock::now() < deadline) {
      out += Receive(50ms);
    }
    return out;
  }

  bool closed() const { return closed_; }

 private:
  static size_t CompleteResponses(const std::string& wire) {
    size_t count = 0;
    for (size_t at = 0;;) {
      const size_t end = wire.find("\r\n\r\n", at);
      if (end == std::string::npos) return count;
      const size_t length_at = wire.find("Content-Length: ", at);
      size_t length = 0;
      if (length_at != std::string::npos && length_at < end) {
        length = std::stoul(wire.substr(length_at + 16));
      }
      if (end + 4 + length > wire.size()) return count;
      ++count;
      at = end + 4 + length;
    }
  }

  int fd_;
  bool connected_ = false;
  bool closed_ = false;
};

struct Served {
  std::unique_ptr<MetricsServer> server;
  std::shared_ptr<std::atomic<int>> renders = std::make_shared<std::atomic<int>>(0);
};

Served Serve(size_t max_connections, std::chrono::milliseconds request_timeout,
             double max_requests_per_second = 1000, size_t request_burst = 1000) {
  Served served;
  MetricsServerOptions options;
  options.max_connections = max_connections;
  options.request_timeout = request_timeout;
  options.max_requests_per_second = max_requests_per_second;
  options.request_burst = request_burst;
  options.handlers.render_metrics = [renders = served.renders] {
    ++*renders;
    return std::string("strata_up 1\n");
  };
  options.handlers.render_status = [] { return std::string("{}\n"); };
  auto started = MetricsServer::Start(std::move(options));
  EXPECT_TRUE(started.ok()) << started.status().ToString();
  if (started.ok()) served.server = std::move(*started);
  return served;
}

const std::string kGet = "GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n";

TEST(MetricsServerTest, ListensOnLoopbackByDefault) {
  EXPECT_EQ(MetricsServerOptions().address, "127.0.0.1");
  MetricsServerOptions bad;
  bad.address = "not an address";
  EXPECT_EQ(MetricsServer::Start(bad).status().code(), StatusCode::kInvalidArgument);
  bad.address = "127.0.0.1";
  bad.max_connections = 0;
  EXPECT_EQ(MetricsServer::Start(bad).status().code(), StatusCode::kInvalidArgument);
  bad.max_connections = 1;
  bad.request_timeout = std::chrono::milliseconds(0);
  EXPECT_EQ(MetricsServer::Start(bad).status().code(), StatusCode::kInvalidArgument);
}

TEST(MetricsServerTest, AConnectionLingeringAfterItsAnswerGivesWayFirst) {
  Served s = Serve(2, 10s);
  ASSERT_TRUE(s.server);
  Client idle(s.server->port());  // Waiting longest: a scraper's keep-alive connection.
  ASSERT_TRUE(idle.connected());
  std::this_thread::sleep_for(50ms);
  Client refused(s.server->port());  // Answered 413, then lingers: its client keeps it open.
  ASSERT_TRUE(refused.Send("GET /metrics HTTP/1.1\r\nContent-Length: 100000\r\n\r\n"));
  EXPECT_EQ(refused.Receive(300ms).rfind("HTTP/1.1 413", 0), 0u);
  Client third(s.server->port());
  ASSERT_TRUE(third.Send(kGet));
  EXPECT_EQ(third.ReceiveResponses(1, 2s).rfind("HTTP/1.1 200", 0), 0u);
  // The lingering one was closed for it, not the scraper's.
  ASSERT_TRUE(idle.Send(kGet));
  const std::string wire = idle.ReceiveResponses(1, 2s);
  EXPECT_EQ(wire.rfind("HTTP/1.1 200", 0), 0u) << "the idle scraper was closed: " << wire;
}

TEST(MetricsServerTest, ALongRequestLineInPiecesIsJudgedAsTheWholeHeader) {
  Served s = Serve(8, 5s);
  ASSERT_TRUE(s.server);
  const std::string line = "GET /metrics?" + std::string(600, 'q') + " HTTP/1.1\r\n";
  const std::string fields = "X-Pad: " + std::string(9000, 'x') + "\r\n\r\n";
  {
    Client client(s.server->port());
    ASSERT_TRUE(client.Send(line + fields));
    EXPECT_EQ(client.Receive(2s).rfind("HTTP/1.1 431", 0), 0u);
  }
  {
    Client client(s.server->port());
    ASSERT_TRUE(client.Send("GET /metr"));
    std::this_thread::sleep_for(50ms);
    ASSERT_TRUE(client.Send(line.substr(9) + fields));
    EXPECT_EQ(client.Receive(2s).rfind("HTTP/1.1 431", 0), 0u);
  }
  {
    // The same bytes in memory get the same answer.
    EXPECT_EQ(AnswerAll(line + fields, {}).rfind("HTTP/1.1 431", 0), 0u);
  }
}

TEST(MetricsServerTest, ConnectionsAreBoundedAndTheLongestIdleGivesWay) {
  constexpr size_t kMax = 4;
  Served s = Serve(kMax, 10s);
  ASSERT_TRUE(s.server);
  // kMax idle connections (a slowloris holding them), the first one a byte into a request.
  std::vector<std::unique_ptr<Client>> idle;
  for (size_t i = 0; i < kMax; ++i) {
    idle.push_back(std::make_unique<Client>(s.server->port()));
    ASSERT_TRUE(idle.back()->connected());
    if (i == 0) idle.back()->Send("G");
    std::this_thread::sleep_for(20ms);  // So that they are accepted in this order.
  }
  // A scraper still gets its answer, at once, and the oldest idle connection is closed for it.
  for (size_t round = 0; round < 2 * kMax; ++round) {
    Client scraper(s.server->port());
    ASSERT_TRUE(scraper.connected());
    ASSERT_TRUE(scraper.Send(kGet));
    const std::string wire = scraper.ReceiveResponses(1, 2s);
    EXPECT_EQ(wire.rfind("HTTP/1.1 200 OK", 0), 0u) << "round " << round << ": " << wire;
  }
  idle[0]->Receive(1s);
  EXPECT_TRUE(idle[0]->closed()) << "the longest-waiting connection was kept";
}

TEST(MetricsServerTest, ATricklingRequestIsCutOffAtTheTimeout) {
  Served s = Serve(8, 300ms);
  ASSERT_TRUE(s.server);
  Client slow(s.server->port());
  ASSERT_TRUE(slow.connected());
  const auto start = std::chrono::steady_clock::now();
  // One byte every 50 ms: each byte is progress, but the whole request never arrives in time.
  for (char c : std::string("GET /metrics HTTP/1.1\r\nX-Slow: ")) {
    if (!slow.Send(std::string(1, c))) break;
    if (!slow.Receive(50ms).empty() || slow.closed()) break;
  }
  slow.Receive(1s);
  EXPECT_TRUE(slow.closed());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  EXPECT_EQ(*s.renders, 0);

  // An idle keep-alive connection goes the same way; a prompt client is unaffected.
  Client idle(s.server->port());
  ASSERT_TRUE(idle.Send(kGet));
  EXPECT_EQ(idle.ReceiveResponses(1, 2s).rfind("HTTP/1.1 200", 0), 0u);
  idle.Receive(1s);
  EXPECT_TRUE(idle.closed());
}

TEST(MetricsServerTest, PipelinedAndOversizedRequestsOverASocket) {
  Served s = Serve(8, 5s);
  ASSERT_TRUE(s.server);
  {
    Client client(s.server->port());
    std::string burst;
    for (int i = 0; i < 100; ++i) burst += kGet;
    ASSERT_TRUE(client.Send(burst));
    const std::string wire = client.ReceiveResponses(100, 5s);
    size_t answers = 0;
    for (size_t at = wire.find("HTTP/1.1 200"); at != std::string::npos;
         at = wire.find("HTTP/1.1 200", at + 1)) {
      ++answers;
    }
    EXPECT_EQ(answers, 100u);
    EXPECT_FALSE(client.closed());
  }
  {
    Client client(s.server->port());
    // Sent in pieces, as a client streaming a huge header would: refused at the limit, not
    // after reading all of it.
    ASSERT_TRUE(client.Send("GET /metrics HTTP/1.1\r\nX-Pad: "));
    for (int i = 0; i < 8 && client.Send(std::string(4096, 'x')); ++i) {
    }
    const std::string wire = client.Receive(2s);
    EXPECT_EQ(wire.rfind("HTTP/1.1 431", 0), 0u) << wire;
    EXPECT_TRUE(client.closed());
  }
  {
    Client client(s.server->port());
    ASSERT_TRUE(client.Send("GET /metrics HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n"));
    const std::string wire = client.Receive(2s);
    EXPECT_EQ(wire.rfind("HTTP/1.1 413", 0), 0u) << wire;
    EXPECT_TRUE(client.closed());
  }
  // Still serving.
  Client after(s.server->port());
  ASSERT_TRUE(after.Send(kGet));
  EXPECT_EQ(after.ReceiveResponses(1, 2s).rfind("HTTP/1.1 200", 0), 0u);
}

TEST(MetricsServerTest, AFloodIsAnsweredInOrderAtTheRateAfterItsBurst) {
  // 5 at once, then 20 a second: 25 requests cannot all be answered in under a second.
  Served s = Serve(8, 5s, /*max_requests_per_second=*/20, /*request_burst=*/5);
  ASSERT_TRUE(s.server);
  Client client(s.server->port());
  std::string burst;
  for (int i = 0; i < 24; ++i) burst += kGet;
  burst += "GET /status HTTP/1.1\r\nHost: t\r\n\r\n";
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(client.Send(burst));
  const std::string wire = client.ReceiveResponses(25, 30s);
  const auto took = std::chrono::steady_clock::now() - start;
  size_t answers = 0;
  for (size_t at = wire.find("HTTP/1.1 200"); at != std::string::npos;
       at = wire.find("HTTP/1.1 200", at + 1)) {
    ++answers;
  }
  EXPECT_EQ(answers, 25u);
  EXPECT_EQ(wire.substr(wire.size() - 3), "{}\n") << "the last answer is not /status";
  EXPECT_GE(took, 950ms);
  EXPECT_EQ(s.renders->load(), 24);
}

TEST(MetricsServerTest, PacingMustAllowSomeRequests) {
  for (const auto& [rate, burst] : {std::pair{0.0, size_t{1}}, std::pair{-1.0, size_t{1}},
                                    std::pair{10.0, size_t{0}}}) {
    MetricsServerOptions options;
    options.max_requests_per_second = rate;
    options.request_burst = burst;
    const auto started = MetricsServer::Start(std::move(options));
    ASSERT_FALSE(started.ok());
    EXPECT_NE(started.status().message().find("max_requests_per_second"), std::string::npos);
  }
}

}  // namespace
}  // namespace strata::tools
