#include "metrics_server.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <thread>

#include "strata/core/asio.h"  // First: it fixes Boost 1.74's include order.

namespace strata::tools {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

class MetricsServer::Impl {
 public:
  explicit Impl(MetricsServerOptions options) : options_(std::move(options)), acceptor_(context_) {}

  ~Impl() {
    // Stopped and joined first; the acceptor and any sessions close as their objects die.
    context_.stop();
    if (thread_.joinable()) thread_.join();
  }

  Status Listen() {
    boost::system::error_code ec;
    const asio::ip::address address = asio::ip::make_address(options_.address, ec);
    if (ec) return InvalidArgument("--metrics-address " + options_.address + ": " + ec.message());
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
    thread_ = std::thread([this] { context_.run(); });
    return Status();
  }

  uint16_t port() const { return port_; }

 private:
  asio::awaitable<void> Accept() {
    for (;;) {
      boost::system::error_code ec;
      tcp::socket socket =
          co_await acceptor_.async_accept(asio::redirect_error(asio::use_awaitable, ec));
      if (ec == asio::error::operation_aborted || !acceptor_.is_open()) co_return;
      if (ec) continue;
      asio::co_spawn(context_, Serve(std::move(socket)), asio::detached);
    }
  }

  http::response<http::string_body> Respond(const http::request<http::string_body>& request) {
    auto reply = [&](http::status status, std::string content_type, std::string body) {
      http::response<http::string_body> response(status, request.version());
      response.set(http::field::server, "strata");
      response.set(http::field::content_type, content_type);
      response.keep_alive(request.keep_alive());
      response.body() = std::move(body);
      response.prepare_payload();
      return response;
    };
    if (request.method() != http::verb::get && request.method() != http::verb::head) {
      auto response = reply(http::status::method_not_allowed, "text/plain", "only GET\n");
      response.set(http::field::allow, "GET, HEAD");
      return response;
    }
    const beast::string_view target = request.target();
    const beast::string_view path = target.substr(0, target.find('?'));
    if (path == "/metrics") {
      return reply(http::status::ok, "text/plain; version=0.0.4; charset=utf-8",
                   options_.render_metrics());
    }
    if (path == "/status") {
      return reply(http::status::ok, "application/json", options_.render_status());
    }
    return reply(http::status::not_found, "text/plain", "not found; try /metrics or /status\n");
  }

  asio::awaitable<void> Serve(tcp::socket socket) {
    beast::tcp_stream stream(std::move(socket));
    beast::flat_buffer buffer;
    for (;;) {
      http::request<http::string_body> request;
      stream.expires_after(std::chrono::seconds(30));
      boost::system::error_code ec;
      co_await http::async_read(stream, buffer, request,
                                asio::redirect_error(asio::use_awaitable, ec));
      if (ec == http::error::end_of_stream || ec == beast::error::timeout ||
          ec == asio::error::operation_aborted || ec == asio::error::eof) {
        break;
      }
      if (ec) {
        // The request did not parse: say so and close the connection.
        http::response<http::string_body> bad(http::status::bad_request, 11);
        bad.set(http::field::content_type, "text/plain");
        bad.keep_alive(false);
        bad.body() = "bad request: " + ec.message() + "\n";
        bad.prepare_payload();
        co_await http::async_write(stream, bad, asio::redirect_error(asio::use_awaitable, ec));
        break;
      }
      http::response<http::string_body> response = Respond(request);
      const bool keep_alive = response.keep_alive();
      co_await http::async_write(stream, response, asio::redirect_error(asio::use_awaitable, ec));
      if (ec || !keep_alive) break;
    }
    boost::system::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }

  MetricsServerOptions options_;
  asio::io_context context_;
  tcp::acceptor acceptor_;
  std::thread thread_;
  uint16_t port_ = 0;
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
