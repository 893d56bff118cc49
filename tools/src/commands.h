// The strata tool's commands. Each takes the arguments after its command words and returns the
// process exit status: 0 on success, 1 when the work failed, 2 for bad usage.
#pragma once

#include <string>
#include <vector>

namespace strata::tools {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

int RunInfo(const std::vector<std::string>& args);
int RunConfig(const std::vector<std::string>& args);
int RunBench(const std::vector<std::string>& args);
int RunBenchNvme(const std::vector<std::string>& args);
int RunBenchAdam(const std::vector<std::string>& args);

/// Prints "strata: error: <message>" to stderr, with a pointer to --help for usage errors.
int Fail(int exit_code, const std::string& message, const std::string& command = "");

}  // namespace strata::tools
