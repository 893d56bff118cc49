// Any bytes as what a client sends on one connection to the metrics endpoint: answered with the
// server's own parser limits and responses (metrics_http.h), never a crash, a hang or an
// exception, and every answer is one the endpoint may give. Found crashes become tests in
// tests/tools/metrics_http_test.cpp.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "metrics_http.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const strata::tools::MetricsHandlers handlers{
      .render_metrics = [] { return std::string("strata_up 1\n"); },
      .render_status = [] { return std::string("{}\n"); }};
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const std::string wire = strata::tools::AnswerAll(bytes, handlers);
  if (bytes.empty()) return wire.empty() ? 0 : (__builtin_trap(), 0);
  // At least one response, and the first has a status the endpoint gives.
  if (wire.rfind("HTTP/1.", 0) != 0 || wire.size() < 12) __builtin_trap();
  static constexpr std::string_view kStatuses[] = {"200", "400", "404", "405", "413", "414", "431"};
  const std::string_view status = std::string_view(wire).substr(9, 3);
  bool known = false;
  for (std::string_view s : kStatuses) known = known || s == status;
  if (!known) __builtin_trap();
  return 0;
}
