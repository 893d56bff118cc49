// The metrics endpoint's answers to request bytes, without sockets: what AnswerAll (the same
// parser limits and responses the server uses) writes back for each kind of input.
#include "metrics_http.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace strata::tools {
namespace {

MetricsHandlers Handlers() {
  return {.render_metrics = [] { return std::string("strata_up 1\n"); },
          .render_status = [] { return std::string("{\"step\":3}\n"); }};
}

/// The status codes of the responses in `wire`, in order.
std::vector<int> Statuses(const std::string& wire) {
  std::vector<int> codes;
  for (size_t at = wire.find("HTTP/1."); at != std::string::npos;
       at = wire.find("HTTP/1.", at + 1)) {
    codes.push_back(std::stoi(wire.substr(at + 9, 3)));
  }
  return codes;
}

TEST(MetricsHttpTest, PipelinedRequestsAreAnsweredInOrder) {
  const std::string wire = AnswerAll(
      "GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n"
      "GET /status?pretty HTTP/1.1\r\nHost: a\r\n\r\n"
      "GET /nope HTTP/1.1\r\nHost: a\r\n\r\n"
      "POST /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
      Handlers());
  EXPECT_EQ(Statuses(wire), (std::vector<int>{200, 200, 404, 405})) << wire;
  EXPECT_LT(wire.find("strata_up 1\n"), wire.find("{\"step\":3}"));
  EXPECT_NE(wire.find("Allow: GET, HEAD"), std::string::npos);
}

TEST(MetricsHttpTest, HeadGetsTheLengthAndNoBody) {
  const std::string wire =
      AnswerAll("HEAD /metrics HTTP/1.1\r\nHost: a\r\n\r\nGET /status HTTP/1.1\r\nHost: a\r\n\r\n",
                Handlers());
  EXPECT_EQ(Statuses(wire), (std::vector<int>{200, 200})) << wire;
  EXPECT_NE(wire.find("Content-Length: 12\r\n"), std::string::npos) << wire;
  EXPECT_EQ(wire.find("strata_up"), std::string::npos) << "HEAD sent a body";
  // The second response begins right where the first one's header ends.
  EXPECT_NE(wire.find("\r\n\r\nHTTP/1.1 200"), std::string::npos) << wire;
}

TEST(MetricsHttpTest, ASmallBodyOnGetIsReadAndIgnored) {
  const std::string wire = AnswerAll(
      "GET /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
      "GET /status HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
      "GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n",
      Handlers());
  EXPECT_EQ(Statuses(wire), (std::vector<int>{200, 200, 200})) << wire;
}

TEST(MetricsHttpTest, OversizedInputGets4xxAndClosesTheConnection) {
  const std::string pipelined_after = "GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n";

  const std::string long_line =
      "GET /" + std::string(kMaxRequestHeaderBytes + 10, 'a') + " HTTP/1.1\r\n\r\n";
  std::string wire = AnswerAll(long_line + pipelined_after, Handlers());
  EXPECT_EQ(Statuses(wire), std::vector<int>{414}) << wire.substr(0, 200);
  EXPECT_NE(wire.find("Connection: close"), std::string::npos);

  const std::string long_header =
      "GET /metrics HTTP/1.1\r\nHost: a\r\nX-Pad: " + std::string(kMaxRequestHeaderBytes, 'b') +
      "\r\n\r\n";
  wire = AnswerAll(long_header + pipelined_after, Handlers());
  EXPECT_EQ(Statuses(wire), std::vector<int>{431}) << wire.substr(0, 200);

  std::string many_headers = "GET /metrics HTTP/1.1\r\nHost: a\r\n";
  for (int i = 0; i < 1000; ++i) many_headers += "X-" + std::to_string(i) + ": 1\r\n";
  wire = AnswerAll(many_headers + "\r\n" + pipelined_after, Handlers());
  EXPECT_EQ(Statuses(wire), std::vector<int>{431});

  const std::string big_body = "GET /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: " +
                               std::to_string(kMaxRequestBodyBytes + 1) + "\r\n\r\n" +
                               std::string(kMaxRequestBodyBytes + 1, 'c');
  wire = AnswerAll(big_body + pipelined_after, Handlers());
  EXPECT_EQ(Statuses(wire), std::vector<int>{413}) << wire;

  std::string chunked = "GET /metrics HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (size_t sent = 0; sent <= kMaxRequestBodyBytes; sent += 1000) {
    chunked += "3e8\r\n" + std::string(1000, 'd') + "\r\n";
  }
  wire = AnswerAll(chunked + "0\r\n\r\n" + pipelined_after, Handlers());
  EXPECT_EQ(Statuses(wire), std::vector<int>{413}) << wire;
}

TEST(MetricsHttpTest, TheHeaderLimitCoversRequestLineAndFieldsTogether) {
  // Read as the server reads (a first piece of 512 bytes), a long request line arrives in
  // pieces; the limit is then on the whole header, and the answer is 431, not 414.
  const std::string long_url = "GET /metrics?" + std::string(600, 'q') + " HTTP/1.1\r\n";
  std::string wire =
      AnswerAll(long_url + "X-Pad: " + std::string(9000, 'x') + "\r\n\r\n", Handlers());
  EXPECT_EQ(Statuses(wire), std::vector<int>{431}) << wire;
  wire = AnswerAll("GET /metrics?" + std::string(5000, 'q') +
                       " HTTP/1.1\r\nX-Pad: " + std::string(5000, 'x') + "\r\n\r\n",
                   Handlers());
  EXPECT_EQ(Statuses(wire), std::vector<int>{431}) << wire;
  // Under the limit together: answered.
  wire = AnswerAll(long_url + "X-Pad: " + std::string(4000, 'x') + "\r\n\r\n", Handlers());
  EXPECT_EQ(Statuses(wire), std::vector<int>{200}) << wire;
}

TEST(MetricsHttpTest, AnEndlessTrailerIsRefusedAsTooLarge) {
  const std::string wire =
      AnswerAll("GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-Trailer: " +
                    std::string(20000, 't') + "\r\n\r\n",
                Handlers());
  EXPECT_EQ(Statuses(wire), std::vector<int>{413}) << wire;
}

TEST(MetricsHttpTest, WhatIsNotHttpGets400) {
  for (const std::string input :
       {"hello\r\n\r\n", "GET /metrics HTTP/9.9\r\n\r\n", "GET /metrics HTTP/1.1\r\nHost a\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"}) {
    const std::string wire = AnswerAll(input, Handlers());
    EXPECT_EQ(Statuses(wire), std::vector<int>{400}) << input << "\n" << wire;
    EXPECT_NE(wire.find("Connection: close"), std::string::npos);
  }
}

TEST(MetricsHttpTest, ARequestCutShortIsAnErrorAndNothingAfterClosesIsAnswered) {
  EXPECT_EQ(Statuses(AnswerAll("GET /metrics HTTP/1.1\r\nHost:", Handlers())),
            std::vector<int>{400});
  EXPECT_EQ(Statuses(AnswerAll("GET /metrics HTTP/1.1\r\nContent-Length: 9\r\n\r\nab", Handlers())),
            std::vector<int>{400});
  // Connection: close and HTTP/1.0 end the connection after their answer.
  EXPECT_EQ(Statuses(AnswerAll("GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n"
                               "GET /status HTTP/1.1\r\n\r\n",
                               Handlers())),
            std::vector<int>{200});
  EXPECT_EQ(
      Statuses(AnswerAll("GET /metrics HTTP/1.0\r\n\r\nGET /status HTTP/1.1\r\n\r\n", Handlers())),
      std::vector<int>{200});
}

}  // namespace
}  // namespace strata::tools
