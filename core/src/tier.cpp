#include "strata/core/tier.h"

#include <string>

namespace strata {
namespace {

char ToLower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

bool EqualsIgnoreCase(std::string_view text, std::string_view lower_case_name) {
  if (text.size() != lower_case_name.size()) return false;
  for (size_t i = 0; i < text.size(); ++i) {
    if (ToLower(text[i]) != lower_case_name[i]) return false;
  }
  return true;
}

}  // namespace

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "unknown";
}

Result<Tier> ParseTier(std::string_view text) {
  struct Alias {
    std::string_view name;
    Tier tier;
  };
  // DeepSpeed's offload "device" settings: "cpu" is host memory, and "none" (no offload) leaves
  // the state on the accelerator.
  static constexpr Alias kAliases[] = {
      {"device", Tier::kDevice}, {"gpu", Tier::kDevice}, {"cuda", Tier::kDevice},
      {"none", Tier::kDevice},   {"host", Tier::kHost},  {"cpu", Tier::kHost},
      {"nvme", Tier::kNvme},
  };
  for (const Alias& alias : kAliases) {
    if (EqualsIgnoreCase(text, alias.name)) return alias.tier;
  }
  std::string message = "unknown tier \"";
  message += text;
  message += "\": expected device (or gpu, cuda, none), host (or cpu) or nvme";
  return InvalidArgument(std::move(message));
}

}  // namespace strata
