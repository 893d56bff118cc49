#include "metrics_server.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <list>
#include <thread>

#include "metrics_http.h"
#include "strata/core/asio.h"  // First: it fixes Boost 1.74's include order.
#include "strata/core/log.h"

namespace strata::tools {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

/// The nice value of the server's thread: above training's, so that a flood of requests gets
/// the CPU time training leaves rather than taking it from training.
constexpr int kServerNice = 10;

/// How long, and for how many bytes at most, a closing connection reads what its client still
/// sends (LingerAndClose).
constexpr int kLingerMilliseconds = 1000;
constexpr size_t kLingerMaxBytes = 1 << 20;

/// One open connection, owned by the coroutine that serves it.
struct Connection {
  explicit Connection(tcp::socket socket) : stream(std::move(socket)) {}
  beast::tcp_stream stream;
  std::list<Connection*>::iterator place;  ///< In Impl::waiting_, while registered.
  bool evicted = false;
};

}  // namespace

class MetricsServer::Impl {
 public:
  explicit Impl(MetricsServerOptions options) : options_(std::move(options)), acceptor_(context_) {}

  ~Impl() {
    // Stopped and joined first; the acceptor and any connections close as their objects die.
    context_.stop();
    if (thread_.joinable()) thread_.join();
  }

  Status Listen() {
    if (options_.max_connections == 0) return InvalidArgument("metrics: max_connections is 0");
    if (options_.request_timeout <= std::chrono::milliseconds(0)) {
      return InvalidArgument("metrics: request_timeout must be positive");
    }
    if (!(options_.max_requests_per_second > 0) || options_.request_burst == 0) {
      return InvalidArgument("metrics: max_requests_per_second must be positive and "
                             "request_burst at least 1");
    }
    answer_interval_ = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(1.0 / options_.max_requests_per_second));
    boost::system::error_code ec;
    asio::ip::address address = asio::ip::make_address(options_.address, ec);
    if (ec) {
      // A host name ("localhost"): its first address, as a listening server resolves one.
      tcp::resolver resolver(context_);
      const auto resolved = resolver.resolve(options_.address, "", ec);
      if (ec || resolved.empty()) {
        return InvalidArgument("--metrics-address " + options_.address +
                               ": not an IP address, nor a host name that resolves (" +
                               (ec ? ec.message() : std::string("no address")) +
                               "); give an address of this machine, such as 127.0.0.1, ::1 or "
                               "0.0.0.0 (every interface)");
      }
      address = resolved.begin()->endpoint().address();
    }
    const tcp::endpoint endpoint(address, options_.port);
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return Unavailable("cannot serve metrics on " + options_.address + ":" +
                         std::to_string(options_.port) + ": " + ec.message());
    }
    port_ = acceptor_.local_endpoint().port();
    asio::co_spawn(context_, Accept(), asio::detached);
    thread_ = std::thread([this] {
      if (setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), kServerNice) != 0) {
        Log(LogLevel::kWarning, "metrics: cannot lower the server thread's priority");
      }
      context_.run();
    });
    return Status();
  }

  uint16_t port() const { return port_; }

 private:
  asio::awaitable<void> Accept() {
    asio::steady_timer backoff(context_);
    for (;;) {
      boost::system::error_code ec;
      tcp::socket socket =
          co_await acceptor_.async_accept(asio::redirect_error(asio::use_awaitable, ec));
      if (ec == asio::error::operation_aborted || !acceptor_.is_open()) co_return;
      if (ec) {
        // Out of descriptors or memory for now: accepting again at once would spin.
        backoff.expires_after(std::chrono::milliseconds(50));
        co_await backoff.async_wait(asio::redirect_error(asio::use_awaitable, ec));
        continue;
      }
      if (waiting_.size() >= options_.max_connections) EvictLongestWaiting();
      asio::co_spawn(context_, Serve(std::move(socket)), asio::detached);
    }
  }

  /// Closes the connection whose current wait began first; its coroutine ends with its pending
  /// read or write aborted.
  void EvictLongestWaiting() {
    Connection* oldest = waiting_.front();
    waiting_.pop_front();
    oldest->evicted = true;
    oldest->stream.close();
  }

  /// Marks `connection` as waiting from now on (for a request, or for its client to read).
  void StartWaiting(Connection& connection) {
    if (connection.evicted) return;
    waiting_.splice(waiting_.end(), waiting_, connection.place);
    connection.stream.expires_after(options_.request_timeout);
  }

  /// When the request read now may be answered: at once while the burst lasts, then one
  /// answer_interval_ after the previous turn. Turns are handed out in the order requests
  /// arrive, so pipelined and competing requests are answered in order.
  std::chrono::steady_clock::time_point TakeTurn() {
    const auto now = std::chrono::steady_clock::now();
    const auto earliest =
        now - answer_interval_ * static_cast<int64_t>(options_.request_burst - 1);
    const auto turn = std::max(next_turn_, earliest);
    next_turn_ = turn + answer_interval_;
    return std::max(turn, now);
  }

  asio::awaitable<void> Serve(tcp::socket socket) {
    Connection connection(std::move(socket));
    connection.place = waiting_.insert(waiting_.end(), &connection);
    struct Unregister {
      Impl& impl;
      Connection& connection;
      ~Unregister() {
        if (!connection.evicted) impl.waiting_.erase(connection.place);
      }
    } unregister{*this, connection};

    // Bounded so that a request cannot make the buffer grow past what the parser accepts.
    beast::flat_buffer buffer(kMaxBufferedRequestBytes);
    for (;;) {
      StartWaiting(connection);
      HttpRequestParser parser;
      LimitRequestParser(parser);
      boost::system::error_code ec;
      co_await http::async_read(connection.stream, buffer, parser,
                                asio::redirect_error(asio::use_awaitable, ec));
      if (connection.evicted || ec == http::error::end_of_stream || ec == beast::error::timeout ||
          ec == asio::error::operation_aborted || ec == asio::error::eof ||
          ec == asio::error::connection_reset) {
        break;
      }
      if (const auto turn = TakeTurn(); turn > std::chrono::steady_clock::now()) {
        // Its own error code: ec still says how the read ended.
        boost::system::error_code waited;
        asio::steady_timer pace(context_, turn);
        co_await pace.async_wait(asio::redirect_error(asio::use_awaitable, waited));
        if (connection.evicted || waited) break;
      }
      const auto unparsed = buffer.cdata();
      HttpResponse response =
          ec ? AnswerParseError(ec, parser,
                                {static_cast<const char*>(unparsed.data()), unparsed.size()})
             : Answer(parser.get(), options_.handlers);
      const bool keep_alive = response.keep_alive();
      StartWaiting(connection);
      co_await http::async_write(connection.stream, response,
                                 asio::redirect_error(asio::use_awaitable, ec));
      if (ec || !keep_alive || connection.evicted) break;
    }
    if (!connection.evicted) co_await LingerAndClose(connection);
  }

  /// Ends the connection as a server should that may not have read all its client sent (a
  /// refused oversized request): closing with bytes unread would reset the connection, and the
  /// client could lose the response before reading it. So: stop sending, then read and drop
  /// what still comes for a short while.
  asio::awaitable<void> LingerAndClose(Connection& connection) {
    boost::system::error_code ec;
    connection.stream.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) co_return;
    // Done with, so the first to go should a new connection need room.
    waiting_.splice(waiting_.begin(), waiting_, connection.place);
    connection.stream.expires_after(std::min<std::chrono::milliseconds>(
        options_.request_timeout, std::chrono::milliseconds(kLingerMilliseconds)));
    std::array<char, 4096> sink;
    for (size_t dropped = 0; dropped < kLingerMaxBytes && !connection.evicted;) {
      dropped += co_await connection.stream.async_read_some(
          asio::buffer(sink), asio::redirect_error(asio::use_awaitable, ec));
      if (ec) break;
    }
  }

  MetricsServerOptions options_;
  /// Open connections in the order they give way to a new one: those lingering after their
  /// last answer, then the one waiting longest. Only the server's thread touches it.
  /// Declared before context_: destroying the context destroys the coroutines still suspended,
  /// and each takes its connection off this list.
  std::list<Connection*> waiting_;
  asio::io_context context_;
  tcp::acceptor acceptor_;
  std::thread thread_;
  uint16_t port_ = 0;
  /// Pacing (TakeTurn); only the server's thread touches next_turn_.
  std::chrono::steady_clock::duration answer_interval_{};
  std::chrono::steady_clock::time_point next_turn_{};
};

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(MetricsServerOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  STRATA_RETURN_IF_ERROR(impl->Listen());
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsServer::~MetricsServer() = default;
uint16_t MetricsServer::port() const { return impl_->port(); }

}  // namespace strata::tools
