#include "metrics_http.h"

#include <boost/asio/buffer.hpp>
#include <boost/beast/http/error.hpp>
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

HttpResponse AnswerParseError(beast::error_code error, const HttpRequestParser& parser) {
  if (error == http::error::header_limit || error == http::error::buffer_overflow) {
    // The parser fills in the method once it has the whole request line.
    if (parser.get().method_string().empty()) {
      return Refuse(
          http::status::uri_too_long,
          "request line longer than " + std::to_string(kMaxRequestHeaderBytes) + " bytes\n");
    }
    return Refuse(
        http::status::request_header_fields_too_large,
        "request headers longer than " + std::to_string(kMaxRequestHeaderBytes) + " bytes\n");
  }
  if (error == http::error::body_limit) {
    return Refuse(http::status::payload_too_large, "request body longer than " +
                                                       std::to_string(kMaxRequestBodyBytes) +
                                                       " bytes; /metrics and /status take none\n");
  }
  return Refuse(http::status::bad_request, "bad request: " + error.message() + "\n");
}

std::string AnswerAll(std::string_view bytes, const MetricsHandlers& handlers) {
  std::ostringstream out;
  auto send = [&out](const HttpResponse& response) {
    out << response;
    return response.keep_alive();
  };
  // As http::read does on a connection that delivers `bytes` and then ends: feed the parser what
  // is buffered; at the end, a request begun and not finished is an error, none begun is done.
  while (!bytes.empty()) {
    HttpRequestParser parser;
    LimitRequestParser(parser);
    beast::error_code error;
    while (!parser.is_done()) {
      size_t used = 0;
      if (!bytes.empty()) {
        used = parser.put(boost::asio::buffer(bytes.data(), bytes.size()), error);
        bytes.remove_prefix(used);
        if (error == http::error::need_more) error = {};
      }
      if (!error && used == 0) {
        // Everything there is was not enough: the connection ends in the middle of a request.
        parser.put_eof(error);
        if (!error && !parser.is_done()) error = http::error::partial_message;
      }
      if (error) {
        send(AnswerParseError(error, parser));
        return out.str();
      }
    }
    if (!send(Answer(parser.get(), handlers))) break;
  }
  return out.str();
}

}  // namespace strata::tools
