// Byte sizes as people write them: "64MiB", "1.5GiB", "1e9", "4096".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

inline constexpr uint64_t kKiB = uint64_t{1} << 10;
inline constexpr uint64_t kMiB = uint64_t{1} << 20;
inline constexpr uint64_t kGiB = uint64_t{1} << 30;
inline constexpr uint64_t kTiB = uint64_t{1} << 40;

/// Parses a non-negative byte count. Accepts a number (integer, decimal or scientific:
/// "4096", "1.5", "1e9") optionally followed by a unit, case-insensitive, with optional space:
///   binary: K, Ki, KiB, M, Mi, MiB, G, Gi, GiB, T, Ti, TiB  (powers of 1024)
///   decimal: KB, MB, GB, TB                                 (powers of 1000)
///   B (bytes).
/// The result must be a whole number of bytes that fits in 64 bits; "1.5B" and "-1MiB" are
/// InvalidArgument errors that quote the text.
Result<uint64_t> ParseBytes(std::string_view text);

/// Formats with the largest binary unit that keeps the number at least 1, up to two decimals,
/// trailing zeros removed: 67108864 -> "64MiB", 1610612736 -> "1.5GiB", 1000 -> "1000B".
std::string FormatBytes(uint64_t bytes);

/// Formats a rate: FormatBytes(bytes_per_second) + "/s", with decimal units ("2.1GB/s"),
/// as bandwidth is customarily quoted in powers of 1000.
std::string FormatBandwidth(double bytes_per_second);

/// Rounds `value` up to a multiple of `alignment` (a power of two).
constexpr uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) & ~(alignment - 1);
}

}  // namespace strata
