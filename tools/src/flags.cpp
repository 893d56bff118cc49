#include "flags.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <sstream>

#include "strata/core/bytes.h"

namespace strata::tools {

FlagParser::FlagParser(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void FlagParser::AddString(std::string name, std::string* target, std::string value_name,
                           std::string help) {
  flags_.push_back(
      {std::move(name), std::move(value_name), std::move(help), [target](const std::string& v) {
         *target = v;
         return Status();
       }});
}

void FlagParser::AddBool(std::string name, bool* target, std::string help) {
  flags_.push_back({std::move(name), "", std::move(help), [target](const std::string&) {
                      *target = true;
                      return Status();
                    }});
}

void FlagParser::AddBytes(std::string name, uint64_t* target, std::string help) {
  flags_.push_back({std::move(name), "SIZE", std::move(help), [target](const std::string& v) {
                      STRATA_ASSIGN_OR_RETURN(*target, ParseBytes(v));
                      return Status();
                    }});
}

void FlagParser::AddInt(std::string name, int64_t* target, std::string help) {
  flags_.push_back({std::move(name), "N", std::move(help), [target](const std::string& v) {
                      const char* end = v.data() + v.size();
                      auto [ptr, ec] = std::from_chars(v.data(), end, *target);
                      if (ec != std::errc() || ptr != end) {
                        return InvalidArgument("expected an integer, got \"" + v + "\"");
                      }
                      return Status();
                    }});
}

void FlagParser::AddDouble(std::string name, double* target, std::string help) {
  flags_.push_back({std::move(name), "X", std::move(help), [target](const std::string& v) {
                      const char* end = v.data() + v.size();
                      auto [ptr, ec] = std::from_chars(v.data(), end, *target);
                      if (ec != std::errc() || ptr != end || !std::isfinite(*target)) {
                        return InvalidArgument("expected a number, got \"" + v + "\"");
                      }
                      return Status();
                    }});
}

void FlagParser::AddPositional(std::string name, std::string* target, std::string help,
                               bool required) {
  positionals_.push_back({std::move(name), target, std::move(help), required});
}

const FlagParser::Flag* FlagParser::Find(const std::string& name) const {
  for (const Flag& flag : flags_) {
    if (flag.name == name) return &flag;
  }
  return nullptr;
}

Status FlagParser::Parse(const std::vector<std::string>& args) {
  set_.clear();
  size_t next_positional = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      return Status();
    }
    if (arg.rfind("--", 0) != 0 || arg == "--") {
      if (next_positional >= positionals_.size()) {
        return InvalidArgument("unexpected argument \"" + arg + "\"");
      }
      *positionals_[next_positional++].target = arg;
      continue;
    }
    const size_t equals = arg.find('=');
    const std::string name =
        arg.substr(2, equals == std::string::npos ? std::string::npos : equals - 2);
    const Flag* flag = Find(name);
    if (flag == nullptr) return InvalidArgument("unknown flag --" + name);
    std::string value;
    if (flag->value_name.empty()) {
      if (equals != std::string::npos) {
        return InvalidArgument("flag --" + name + " takes no value");
      }
    } else if (equals != std::string::npos) {
      value = arg.substr(equals + 1);
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      return InvalidArgument("flag --" + name + " needs a value (" + flag->value_name + ")");
    }
    Status status = flag->set(value);
    if (!status.ok()) return InvalidArgument("--" + name + ": " + status.message());
    set_.push_back(name);
  }
  for (size_t p = next_positional; p < positionals_.size(); ++p) {
    if (positionals_[p].required) return InvalidArgument("missing " + positionals_[p].name);
  }
  return Status();
}

bool FlagParser::was_set(const std::string& name) const {
  return std::find(set_.begin(), set_.end(), name) != set_.end();
}

std::string FlagParser::Help() const {
  std::ostringstream out;
  out << summary_ << "\n\nUsage: " << command_;
  for (const Positional& p : positionals_) {
    out << (p.required ? " " + p.name : " [" + p.name + "]");
  }
  if (!flags_.empty()) out << " [flags]";
  out << "\n";
  if (!positionals_.empty()) out << "\nArguments:\n";
  for (const Positional& p : positionals_) {
    out << "  " << p.name << std::string(p.name.size() < 24 ? 24 - p.name.size() : 1, ' ') << p.help
        << "\n";
  }
  out << "\nFlags:\n";
  for (const Flag& f : flags_) {
    std::string left = "--" + f.name + (f.value_name.empty() ? "" : " " + f.value_name);
    out << "  " << left << std::string(left.size() < 24 ? 24 - left.size() : 1, ' ') << f.help
        << "\n";
  }
  out << "  --help                  show this help\n";
  return out.str();
}

}  // namespace strata::tools
