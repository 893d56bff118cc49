#include "metrics_http.h"

#include <boost/asio/buffer.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <sstream>

namespace strata::tools {

namespace beast = boost::beast;
namespace http = beast::http;

namespace {

HttpResponse Reply(http::status status, unsigned version, bool keep_alive, const char* content_type,
                   std::string body) {
  HttpResponse response(status, version);
  response.set(http::field::server, "strata");
  response.set(http::field::content_type, content_type);
  response.keep_alive(keep_alive);
  response.body() = std::move(body);
  response.prepare_payload();
  return response;
}

HttpResponse Refuse(http::status status, std::string body) {
  // HTTP/1.1 whatever the request said: it may not have got as far as saying.
  return Reply(status, 11, /*keep_alive=*/false, "text/plain", std::move(body));
}

}  // namespace

void LimitRequestParser(HttpRequestParser& parser) {
  parser.header_limit(kMaxRequestHeaderBytes);
  parser.body_limit(kMaxRequestBodyBytes);
}

HttpResponse Answer(const HttpRequest& request, const MetricsHandlers& handlers) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  if (request.method() != http::verb::get && request.method() != http::verb::head) {
    HttpResponse response = Reply(http::status::method_not_allowed, version, keep_alive,
                                  "text/plain", "only GET and HEAD\n");
    response.set(http::field::allow, "GET, HEAD");
    return response;
  }
  const beast::string_view target = request.target();
  const beast::string_view path = target.substr(0, target.find('?'));
  HttpResponse response =
      path == "/metrics"
          ? Reply(http::status::ok, version, keep_alive, "text/plain; version=0.0.4; charset=utf-8",
                  handlers.render_metrics())
      : path == "/status" ? Reply(http::status::ok, version, keep_alive, "application/json",
                                  handlers.render_status())
                          : Reply(http::status::not_found, version, keep_alive, "text/plain",
                                  "not found; try /metrics or /status\n");
  if (request.method() == http::verb::head) {
    // GET's Content-Length, no body: a client pipelining HEADs must find the next response
    // where the length says it is not.
    response.body().clear();
  }
  return response;
}

HttpResponse AnswerParseError(beast::error_code error, const HttpRequestParser& parser,
                              std::string_view unparsed) {
  if (error == http::error::body_limit ||
      (error == http::error::buffer_overflow && parser.is_header_done())) {
    return Refuse(http::status::payload_too_large, "request body longer than " +
                                                       std::to_string(kMaxRequestBodyBytes) +
                                                       " bytes; /metrics and /status take none\n");
  }
  if (error == http::error::header_limit || error == http::error::buffer_overflow) {
    // The parser fills in the method once it has the request line; before that (it waits for
    // the whole header when the line came in pieces), the buffered bytes say whether it ended.
    const bool line_ended =
        !parser.get().method_string().empty() ||
        unparsed.substr(0, kMaxRequestHeaderBytes).find("\r\n") != std::string_view::npos;
    if (!line_ended) {
      return Refuse(
          http::status::uri_too_long,
          "request line longer than " + std::to_string(kMaxRequestHeaderBytes) + " bytes\n");
    }
    return Refuse(
        http::status::request_header_fields_too_large,
        "request headers longer than " + std::to_string(kMaxRequestHeaderBytes) + " bytes\n");
  }
  return Refuse(http::status::bad_request, "bad request: " + error.message() + "\n");
}

namespace {

/// A connection that delivers `bytes` and then ends, for http::read (a SyncReadStream).
class BytesStream {
 public:
  explicit BytesStream(std::string_view bytes) : rest_(bytes) {}

  template <typename MutableBuffers>
  size_t read_some(const MutableBuffers& buffers, beast::error_code& error) {
    if (rest_.empty()) {
      error = boost::asio::error::eof;
      return 0;
    }
    error = {};
    const size_t n = boost::asio::buffer_copy(buffers, boost::asio::buffer(rest_));
    rest_.remove_prefix(n);
    return n;
  }
  template <typename MutableBuffers>
  size_t read_some(const MutableBuffers& buffers) {
    beast::error_code error;
    const size_t n = read_some(buffers, error);
    if (error) throw beast::system_error(error);
    return n;
  }

 private:
  std::string_view rest_;
};

}  // namespace

std::string AnswerAll(std::string_view bytes, const MetricsHandlers& handlers) {
  BytesStream stream(bytes);
  beast::flat_buffer buffer(kMaxBufferedRequestBytes);
  std::ostringstream out;
  for (;;) {
    HttpRequestParser parser;
    LimitRequestParser(parser);
    beast::error_code error;
    http::read(stream, buffer, parser, error);
    if (error == http::error::end_of_stream) break;  // It ended between requests.
    const auto unparsed = buffer.cdata();
    const HttpResponse response =
        error ? AnswerParseError(error, parser,
                                 {static_cast<const char*>(unparsed.data()), unparsed.size()})
              : Answer(parser.get(), handlers);
    out << response;
    if (!response.keep_alive()) break;
  }
  return out.str();
}

}  // namespace strata::tools
