// A small command-line flag parser for the strata tool: --name value, --name=value, boolean
// --name, positionals, and a generated --help. Unknown flags and bad values are errors.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata::tools {

class FlagParser {
 public:
  /// `command` as the user types it ("strata info"); `summary` is the first line of --help.
  FlagParser(std::string command, std::string summary);

  void AddString(std::string name, std::string* target, std::string value_name, std::string help);
  void AddBool(std::string name, bool* target, std::string help);
  void AddBytes(std::string name, uint64_t* target, std::string help);
  void AddInt(std::string name, int64_t* target, std::string help);
  void AddDouble(std::string name, double* target, std::string help);
  /// A positional argument, in order of declaration.
  void AddPositional(std::string name, std::string* target, std::string help, bool required);

  /// Parses `args` (without the command words). On `--help` sets help_requested() and stops.
  /// Errors name the flag and the value.
  Status Parse(const std::vector<std::string>& args);

  bool help_requested() const { return help_requested_; }
  /// Whether the last Parse saw --`name` (a default it keeps is the caller's to choose).
  bool was_set(const std::string& name) const;
  std::string Help() const;

 private:
  struct Flag {
    std::string name;
    std::string value_name;  // Empty for booleans.
    std::string help;
    std::function<Status(const std::string&)> set;
  };
  struct Positional {
    std::string name;
    std::string* target;
    std::string help;
    bool required;
  };
  const Flag* Find(const std::string& name) const;

  std::string command_;
  std::string summary_;
  std::vector<Flag> flags_;
  std::vector<Positional> positionals_;
  std::vector<std::string> set_;  // Flags the last Parse saw.
  bool help_requested_ = false;
};

}  // namespace strata::tools
