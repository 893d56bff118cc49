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
  FlagParser flags(command,
                   "Validate a Strata or DeepSpeed JSON config and print the options it "
                   "resolves to, in Strata's format. Unused DeepSpeed keys are listed on stderr.");
  flags.AddPositional("FILE", &file, "the config file", /*required=*/true);
  flags.AddString("format", &format_text, "FORMAT", "auto (default), strata or deepspeed");
  if (Status s = flags.Parse(args); !s.ok()) return Fail(kExitUsage, s.message(), command);
  if (flags.help_requested()) {
    std::cout << flags.Help();
    return kExitOk;
  }
  auto format = ParseFormat(format_text);
  if (!format.ok()) return Fail(kExitUsage, format.status().message(), command);

  auto config = LoadConfigFile(file, *format);
  if (!config.ok()) return Fail(kExitFailure, config.status().message());
  if (std::string warning = IgnoredKeysWarning(*config); !warning.empty()) {
    std::cerr << "strata: warning: " << warning << "\n";
  }
  for (const std::string& note : config->auto_resolved) {
    std::cerr << "strata: note: " << note << "\n";
  }
  std::cerr << "strata: " << file << " is a valid " << ConfigFormatName(config->format)
            << " config; resolved options:\n";
  std::cout << OptionsToJson(config->options) << "\n";
  return kExitOk;
}

}  // namespace

int RunConfig(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << "Usage: strata config check FILE [--format auto|strata|deepspeed]\n\n"
                 "Subcommands:\n  check   validate a config file and print the resolved options\n";
    return args.empty() ? kExitUsage : kExitOk;
  }
  if (args[0] == "check") return RunConfigCheck({args.begin() + 1, args.end()});
  return Fail(kExitUsage, "unknown subcommand \"config " + args[0] + "\"", "strata config");
}

}  // namespace strata::tools
