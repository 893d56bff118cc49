// The strata tool's commands. Each takes the arguments after its command words and returns the
// process exit status: 0 on success, 1 when the work failed, 2 for bad usage.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/bytes.h"

namespace strata::tools {

class FlagParser;

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

int RunInfo(const std::vector<std::string>& args);
int RunConfig(const std::vector<std::string>& args);
int RunBench(const std::vector<std::string>& args);
int RunBenchNvme(const std::vector<std::string>& args);
int RunBenchAdam(const std::vector<std::string>& args);
int RunBenchPipeline(const std::vector<std::string>& args);
int RunBenchAll(const std::vector<std::string>& args);
int RunTrain(const std::vector<std::string>& args);
int RunPlan(const std::vector<std::string>& args);

/// A count with a binary suffix, "64Mi" for 64 x 2^20: FormatBytes without its "B".
inline std::string FormatCount(uint64_t count) {
  std::string text = FormatBytes(count);
  if (!text.empty() && text.back() == 'B') text.pop_back();
  return text;
}

/// Where scratch files go by default: $TMPDIR, or /tmp.
inline std::string TempDirectory() {
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
}

/// Prints "strata: error: <message>" to stderr, with a pointer to --help for usage errors.
int Fail(int exit_code, const std::string& message, const std::string& command = "");

/// Parses `args` into `flags`' variables, and says whether `command` ends there: with
/// kExitUsage after Fail's message for flags it refuses, with kExitOk after printing its help
/// for --help; nullopt when it goes on.
std::optional<int> ParseFlags(FlagParser& flags, const std::vector<std::string>& args,
                              const std::string& command);

}  // namespace strata::tools
