// `strata config check FILE`: validate a Strata or DeepSpeed config, print the resolved options.
#include <iostream>

#include "commands.h"
#include "flags.h"
#include "strata/core/config.h"

namespace strata::tools {
namespace {

Result<ConfigFormat> ParseFormat(const std::string& text) {
  if (text == "auto") return ConfigFormat::kAuto;
  if (text == "strata") return ConfigFormat::kStrata;
  if (text == "deepspeed") return ConfigFormat::kDeepSpeed;
  return InvalidArgument("--format: expected auto, strata or deepspeed, got \"" + text + "\"");
}

int RunConfigCheck(const std::vector<std::string>& args) {
  const std::string command = "strata config check";
  std::string file, format_text = "auto";
  int64_t world_size = 1;
  FlagParser flags(command,
                   "Validate a Strata or DeepSpeed JSON config and print the options it "
                   "resolves to, in Strata's format. Unused DeepSpeed keys are listed on stderr.");
  flags.AddPositional("FILE", &file, "the config file", /*required=*/true);
  flags.AddString("format", &format_text, "FORMAT", "auto (default), strata or deepspeed");
  flags.AddInt("world-size", &world_size,
               "data-parallel ranks the config is for: DeepSpeed's batch sizes are checked and "
               "derived with it (default 1)");
  if (const std::optional<int> done = ParseFlags(flags, args, command)) return *done;
  auto format = ParseFormat(format_text);
  if (!format.ok()) return Fail(kExitUsage, format.status().message(), command);

  if (world_size < 1 || world_size > (1 << 20)) {
    return Fail(kExitUsage, "--world-size must be in [1, 1048576]", command);
  }
  auto config = LoadConfigFile(file, *format, int(world_size));
  if (!config.ok()) return Fail(kExitFailure, config.status().message());
  if (std::string warning = IgnoredKeysWarning(*config); !warning.empty()) {
    std::cerr << "strata: warning: " << warning << "\n";
  }
  for (const std::string& note : config->auto_resolved) {
    std::cerr << "strata: note: " << note << "\n";
  }
  std::cerr << "strata: " << file << " is a valid " << ConfigFormatName(config->format)
            << " config; resolved options:\n";
  if (config->train_batch_size) {
    std::cerr << "strata: batch: train_batch_size " << *config->train_batch_size
              << " = micro-batch " << *config->micro_batch_size << " x accumulation "
              << config->options.optimizer.gradient_accumulation_steps << " x world size "
              << world_size << "\n";
  }
  std::cout << OptionsToJson(config->options) << "\n";
  return kExitOk;
}

}  // namespace

int RunConfig(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << "Usage: strata config check FILE [--format auto|strata|deepspeed] "
                 "[--world-size N]\n\n"
                 "Subcommands:\n  check   validate a config file and print the resolved options\n";
    return args.empty() ? kExitUsage : kExitOk;
  }
  if (args[0] == "check") return RunConfigCheck({args.begin() + 1, args.end()});
  return Fail(kExitUsage, "unknown subcommand \"config " + args[0] + "\"", "strata config");
}

}  // namespace strata::tools
