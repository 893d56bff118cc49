#include "strata/core/log.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace strata {
namespace {

LogLevel ThresholdFromEnvironment() {
  // The one place Strata reads STRATA_LOG_LEVEL.
  const char* value = std::getenv("STRATA_LOG_LEVEL");
  const std::string level = value != nullptr ? value : "";
  if (level == "debug") return LogLevel::kDebug;
  if (level == "warning") return LogLevel::kWarning;
  if (level == "error") return LogLevel::kError;
  return LogLevel::kInfo;
}

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "?";
}

std::mutex& SinkMutex() {
  static std::mutex mutex;
  return mutex;
}

LogSink& Sink() {
  static LogSink sink;
  return sink;
}

}  // namespace

void Log(LogLevel level, std::string_view message) {
  static const LogLevel threshold = ThresholdFromEnvironment();
  std::lock_guard lock(SinkMutex());
  if (Sink()) {
    Sink()(level, message);
    return;
  }
  if (level < threshold) return;
  std::fprintf(stderr, "strata: %s: %.*s\n", LevelName(level), static_cast<int>(message.size()),
               message.data());
}

void SetLogSink(LogSink sink) {
  std::lock_guard lock(SinkMutex());
  Sink() = std::move(sink);
}

}  // namespace strata
