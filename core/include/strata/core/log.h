// Minimal logging: one line per message on stderr ("strata: warning: ..."), thread-safe.
// Tests may capture messages by installing a sink.
#pragma once

#include <functional>
#include <string_view>

namespace strata {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

/// Writes `message` at `level` if it is at or above the threshold (default kInfo; the
/// environment variable STRATA_LOG_LEVEL=debug|info|warning|error sets it at first use).
void Log(LogLevel level, std::string_view message);

/// Replaces where messages go (nullptr restores stderr). For tests; not meant to be swapped
/// while other threads log.
using LogSink = std::function<void(LogLevel, std::string_view)>;
void SetLogSink(LogSink sink);

}  // namespace strata
