// What the metrics endpoint answers, apart from sockets: the limits on a request, the response
// to each request and to each way a request can fail to parse. MetricsServer reads requests off
// its connections with these; AnswerAll runs the same parse-and-answer loop over bytes in memory,
// for tests and the request fuzzer (tests/fuzz/metrics_http_fuzzer.cpp).
#pragma once

#include <boost/beast/core/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cstddef>
#include <string>
#include <string_view>

#include "metrics_handlers.h"

namespace strata::tools {

/// A request line and headers larger than this get 431 (414 when the request line alone is);
/// a body larger than kMaxRequestBodyBytes gets 413. A scraper sends a few hundred bytes of
/// header and no body, so both are generous for clients and small for memory.
inline constexpr size_t kMaxRequestHeaderBytes = 8 * 1024;
inline constexpr size_t kMaxRequestBodyBytes = 4 * 1024;
/// What a connection buffers of a request at most (its read buffer's limit): a header and a
/// piece of body. Past it (a chunk extension or trailer that never ends) the request is refused.
inline constexpr size_t kMaxBufferedRequestBytes = kMaxRequestHeaderBytes + kMaxRequestBodyBytes;

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;
using HttpResponse = boost::beast::http::response<boost::beast::http::string_body>;
using HttpRequestParser = boost::beast::http::request_parser<boost::beast::http::string_body>;

/// A parser for the next request on a connection, with the limits above.
void LimitRequestParser(HttpRequestParser& parser);

/// The response to a request that parsed: GET or HEAD of /metrics or /status (a query string is
/// ignored), 404 for other paths, 405 for other methods. HEAD gets GET's headers and no body. The
/// response keeps the connection open when the request asks to.
HttpResponse Answer(const HttpRequest& request, const MetricsHandlers& handlers);

/// The response when a request did not parse: 431 or 414 (too large a header or request line),
/// 413 (too large a body) or 400, always closing the connection. `parser` is the one that
/// failed and `unparsed` what the connection still buffers: together they tell a long request
/// line from long headers.
HttpResponse AnswerParseError(boost::beast::error_code error, const HttpRequestParser& parser,
                              std::string_view unparsed);

/// Answers every request in `bytes` as one connection that delivers them and then ends would,
/// in order, stopping at the first response that closes it: what the server would write back.
/// It reads them as the server does (http::read into a buffer of kMaxBufferedRequestBytes), so
/// the parser sees the same pieces.
std::string AnswerAll(std::string_view bytes, const MetricsHandlers& handlers);

}  // namespace strata::tools
