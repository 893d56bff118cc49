// What DeepSpeed accepts in its config, section by section, so that Strata can tell a key it
// does not use (a warning) from a key nobody knows (an error, with a "did you mean" for typos).
//
// The sections DeepSpeed checks itself — zero_optimization with its offload sections, fp16 and
// bf16 are pydantic models with extra="forbid" — refuse unknown keys there too. The top level
// is a plain dictionary in DeepSpeed; Strata refuses unknown keys there as well, since a
// misspelt section ("zero_optimisation") would otherwise train without what it meant to set.
// Lists as of DeepSpeed's deepspeed/runtime/{config,precision_config}.py and
// runtime/zero/{config,offload_config}.py (2025).
#pragma once

#include <optional>
#include <span>
#include <string_view>

namespace strata::internal {

/// Every top-level key a DeepSpeed config may have.
std::span<const std::string_view> DeepSpeedTopLevelKeys();

/// The keys DeepSpeed accepts in the section at `path` ("zero_optimization",
/// "zero_optimization.offload_param", "fp16", ...) when it refuses others, or nullopt for a
/// section whose unknown keys DeepSpeed ignores (aio, optimizer params, ...).
std::optional<std::span<const std::string_view>> DeepSpeedStrictSectionKeys(std::string_view path);

/// The candidate `key` is most likely a misspelling of (at most two edits away, or a third of
/// its length for long keys), or empty when none is that close.
std::string_view NearMiss(std::string_view key, std::span<const std::string_view> candidates);

}  // namespace strata::internal
