// strata: the command-line tool of the Strata offload engine.
#include <cstring>
#include <exception>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "interrupt.h"

namespace strata::tools {
namespace {

constexpr const char* kUsage = R"(strata — offload engine for training models larger than GPU memory

Usage: strata <command> [flags]

Commands:
  train           train the built-in byte-level language model through the offload engine
  plan            per-GPU memory and communication for data parallel, ZeRO-1/2/3 and offload
  info            CPU, memory, io_uring, file system and GPU facts that matter for offload
  config check    validate a Strata or DeepSpeed config file and print the resolved options
  bench adam      CPU optimizer step vs its memory-bandwidth roofline
  bench nvme      sequential O_DIRECT throughput of a directory through the I/O engine
  bench pipeline  a training step through the offload engine vs its slowest resource
  bench all       every tier benchmark, one summary; JSON/CSV for scripts/plot_bench.py

Run `strata <command> --help` for a command's flags.
)";

}  // namespace

int Fail(int exit_code, const std::string& message, const std::string& command) {
  std::cerr << "strata: error: " << message;
  if (exit_code == kExitUsage && !command.empty()) std::cerr << " (see " << command << " --help)";
  std::cerr << "\n";
  return exit_code;
}

std::optional<int> ParseFlags(FlagParser& flags, const std::vector<std::string>& args,
                              const std::string& command) {
  if (Status s = flags.Parse(args); !s.ok()) return Fail(kExitUsage, s.message(), command);
  if (flags.help_requested()) {
    std::cout << flags.Help();
    return kExitOk;
  }
  return std::nullopt;
}

int RunBench(const std::vector<std::string>& args) {
  constexpr const char* kBenchUsage =
      "Usage: strata bench <benchmark> [flags]\n\n"
      "Benchmarks:\n"
      "  adam      CPU optimizer step vs its memory-bandwidth roofline (same arrays, same run)\n"
      "  nvme      sequential O_DIRECT read/write throughput through the I/O engine\n"
      "  pipeline  a training step through the offload engine vs each resource alone\n"
      "  all       all of the above and host<->device copies, one summary, --out for charts\n";
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << kBenchUsage;
    return args.empty() ? kExitUsage : kExitOk;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "adam") return RunBenchAdam(rest);
  if (args[0] == "nvme") return RunBenchNvme(rest);
  if (args[0] == "pipeline") return RunBenchPipeline(rest);
  if (args[0] == "all") return RunBenchAll(rest);
  return Fail(kExitUsage, "unknown benchmark \"" + args[0] + "\"", "strata bench");
}

}  // namespace strata::tools

namespace {

int Run(std::vector<std::string> args) {
  using namespace strata::tools;
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::cout << kUsage;
    return args.empty() ? kExitUsage : kExitOk;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  if (command == "--version") {
    std::cout << "strata " << STRATA_VERSION << "\n";
    return kExitOk;
  }
  if (command == "train") return RunTrain(args);
  if (command == "plan") return RunPlan(args);
  if (command == "info") return RunInfo(args);
  if (command == "config") return RunConfig(args);
  if (command == "bench") return RunBench(args);
  return Fail(kExitUsage, "unknown command \"" + command + "\"", "strata");
}

}  // namespace

int main(int argc, char** argv) {
  using namespace strata::tools;
  // Every command returns its errors as a Status; an exception reaching here is a bug, and
  // still ends as an error line and exit code 1, never as an abort.
  try {
    const int exit_code = Run(std::vector<std::string>(argv + 1, argv + argc));
    FinishInterrupted(exit_code);
    return exit_code;
  } catch (const std::bad_alloc&) {
    return Fail(kExitFailure, "out of memory");
  } catch (const std::exception& e) {
    return Fail(kExitFailure, std::string("internal error: ") + e.what() +
                                  " (please report it, with the command that caused it)");
  }
}
