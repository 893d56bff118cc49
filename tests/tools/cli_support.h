// Runs the strata executable for CLI tests.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace strata::tools::testing {

struct CliResult {
  int exit_code = -1;
  std::string out;  // stdout and stderr together (stderr is redirected into it)
};

/// Runs `strata <args>` through the shell; `args` is shell text. `env`: variable assignments
/// ("RANK=1 WORLD_SIZE=2") the command runs with, on top of this process's environment.
inline CliResult RunCli(const std::string& args, bool merge_stderr = true,
                        const std::string& env = "") {
  const std::string command = (env.empty() ? "" : "env " + env + " ") + std::string(STRATA_CLI) +
                              " " + args + (merge_stderr ? " 2>&1" : " 2>/dev/null");
  CliResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> chunk{};
  size_t n;
  while ((n = fread(chunk.data(), 1, chunk.size(), pipe)) > 0) result.out.append(chunk.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

}  // namespace strata::tools::testing
