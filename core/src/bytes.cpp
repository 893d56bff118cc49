#include "strata/core/bytes.h"

#include <cmath>
#include <cstdio>
#include <limits>

namespace strata {
namespace {

// Exact arithmetic on sizes up to 2^64 x 100 without floating point. __extension__ keeps
// -Wpedantic quiet about the GCC/Clang builtin type.
__extension__ using Uint128 = unsigned __int128;

constexpr std::string_view kAccepted =
    "expected a non-negative number (such as 4096, 1.5 or 1e9) with an optional unit (B, KiB, MiB, "
    "GiB, TiB, KB, MB, GB, TB, K, M, G, T; KiB and K are 1024 bytes, KB is 1000)";

// The significand is accumulated exactly in 128 bits; more significant digits than this are
// rejected rather than rounded.
constexpr int kMaxSignificantDigits = 36;

Status ByteSizeError(std::string_view text, std::string_view reason) {
  std::string message = "invalid byte size \"";
  message += text;
  message += "\": ";
  message += reason;
  return InvalidArgument(std::move(message));
}

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
char ToLower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

// A unit as a power of two times a power of five: 1024^k = 2^(10k), 1000^k = 2^(3k) * 5^(3k).
struct Unit {
  std::string_view name;  // Lower case.
  int twos;
  int fives;
};

constexpr Unit kUnits[] = {
    {"", 0, 0},   {"b", 0, 0},                                    //
    {"k", 10, 0}, {"ki", 10, 0}, {"kib", 10, 0}, {"kb", 3, 3},    //
    {"m", 20, 0}, {"mi", 20, 0}, {"mib", 20, 0}, {"mb", 6, 6},    //
    {"g", 30, 0}, {"gi", 30, 0}, {"gib", 30, 0}, {"gb", 9, 9},    //
    {"t", 40, 0}, {"ti", 40, 0}, {"tib", 40, 0}, {"tb", 12, 12},  //
};

const Unit* FindUnit(std::string_view text) {
  for (const Unit& unit : kUnits) {
    if (unit.name.size() != text.size()) continue;
    bool equal = true;
    for (size_t i = 0; i < text.size(); ++i) equal = equal && ToLower(text[i]) == unit.name[i];
    if (equal) return &unit;
  }
  return nullptr;
}

// Formats value / 100 with up to two decimals, trailing zeros removed, then the unit.
std::string FormatHundredths(uint64_t hundredths, std::string_view unit) {
  std::string out = std::to_string(hundredths / 100);
  const uint64_t fraction = hundredths % 100;
  if (fraction != 0) {
    out += '.';
    out += static_cast<char>('0' + fraction / 10);
    if (fraction % 10 != 0) out += static_cast<char>('0' + fraction % 10);
  }
  out += unit;
  return out;
}

}  // namespace

Result<uint64_t> ParseBytes(std::string_view text) {
  std::string_view rest = text;
  while (!rest.empty() && IsSpace(rest.front())) rest.remove_prefix(1);
  while (!rest.empty() && IsSpace(rest.back())) rest.remove_suffix(1);
  if (rest.empty())
    return ByteSizeError(text, std::string("empty text; ") + std::string(kAccepted));
  if (rest.front() == '-') {
    return ByteSizeError(text, std::string("a size cannot be negative; ") + std::string(kAccepted));
  }

  // Number: digits [. digits] [e [+-] digits], read exactly as significand * 10^exponent.
  Uint128 significand = 0;
  int64_t exponent = 0;
  int significant_digits = 0;
  bool any_digit = false;
  bool seen_point = false;
  size_t i = 0;
  for (; i < rest.size(); ++i) {
    const char c = rest[i];
    if (c == '.' && !seen_point) {
      seen_point = true;
      continue;
    }
    if (!IsDigit(c)) break;
    any_digit = true;
    if (significand == 0 && c == '0') {
      if (seen_point) --exponent;  // Leading zero: only moves the decimal point.
      continue;
    }
    if (++significant_digits > kMaxSignificantDigits) {
      return ByteSizeError(text, "more than " + std::to_string(kMaxSignificantDigits) +
                                     " significant digits; " + std::string(kAccepted));
    }
    significand = significand * 10 + static_cast<unsigned>(c - '0');
    if (seen_point) --exponent;
  }
  if (!any_digit) return ByteSizeError(text, kAccepted);
  if (i < rest.size() && (rest[i] == 'e' || rest[i] == 'E')) {
    ++i;
    bool negative_exponent = false;
    if (i < rest.size() && (rest[i] == '+' || rest[i] == '-')) {
      negative_exponent = rest[i] == '-';
      ++i;
    }
    if (i >= rest.size() || !IsDigit(rest[i])) return ByteSizeError(text, kAccepted);
    int64_t written_exponent = 0;
    for (; i < rest.size() && IsDigit(rest[i]); ++i) {
      // Saturate: anything this large over- or underflows whatever the significand is.
      if (written_exponent < 1'000'000) written_exponent = written_exponent * 10 + (rest[i] - '0');
    }
    exponent += negative_exponent ? -written_exponent : written_exponent;
  }

  // Unit, after optional space.
  while (i < rest.size() && IsSpace(rest[i])) ++i;
  const Unit* unit = FindUnit(rest.substr(i));
  if (unit == nullptr) return ByteSizeError(text, kAccepted);

  if (significand == 0) return uint64_t{0};

  // value = significand * 10^exponent * 2^unit.twos * 5^unit.fives. Cancel negative powers of
  // two and five against the significand's factors; what is left must be a whole number.
  int64_t twos = exponent + unit->twos;
  int64_t fives = exponent + unit->fives;
  while (twos < 0 && significand % 2 == 0) {
    significand /= 2;
    ++twos;
  }
  while (fives < 0 && significand % 5 == 0) {
    significand /= 5;
    ++fives;
  }
  if (twos < 0 || fives < 0) {
    return ByteSizeError(text,
                         "not a whole number of bytes; write a value that comes to whole bytes "
                         "(1.5KiB = 1536 bytes is fine, 1.33KiB is not)");
  }
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  bool overflow = significand > kMax;
  // Each factor at least doubles a non-zero significand, so these loops stop within 64 steps.
  for (; !overflow && twos > 0; --twos) {
    significand *= 2;
    overflow = significand > kMax;
  }
  for (; !overflow && fives > 0; --fives) {
    significand *= 5;
    overflow = significand > kMax;
  }
  if (overflow) {
    return ByteSizeError(
        text, "larger than the largest size, 18446744073709551615 bytes (2^64 - 1, about 16 EiB)");
  }
  return static_cast<uint64_t>(significand);
}

std::string FormatBytes(uint64_t bytes) {
  static constexpr std::string_view kNames[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  constexpr int kLast = 4;
  int unit = 0;
  while (unit < kLast && bytes >= (uint64_t{1} << (10 * (unit + 1)))) ++unit;
  // Round to hundredths of the unit (half up), exactly. If that reaches 1024 of the unit, say
  // "1MiB" rather than "1024KiB".
  auto hundredths_in = [bytes](int u) {
    const Uint128 divisor = uint64_t{1} << (10 * u);
    return static_cast<uint64_t>((static_cast<Uint128>(bytes) * 100 + divisor / 2) / divisor);
  };
  uint64_t hundredths = hundredths_in(unit);
  if (unit < kLast && hundredths >= uint64_t{1024} * 100) hundredths = hundredths_in(++unit);
  return FormatHundredths(hundredths, kNames[unit]);
}

std::string FormatBandwidth(double bytes_per_second) {
  const std::string_view sign = bytes_per_second < 0 ? "-" : "";
  if (std::isnan(bytes_per_second)) return "nanB/s";
  if (std::isinf(bytes_per_second)) return std::string(sign) + "infB/s";
  static constexpr std::string_view kNames[] = {"B", "KB", "MB", "GB", "TB"};
  constexpr int kLast = 4;
  const double magnitude = std::fabs(bytes_per_second);
  int unit = 0;
  double scale = 1;
  while (unit < kLast && magnitude >= scale * 1000) {
    ++unit;
    scale *= 1000;
  }
  double hundredths = std::round(magnitude / scale * 100);
  if (unit < kLast && hundredths >= 1000 * 100) {  // "1GB/s" rather than "1000MB/s".
    ++unit;
    scale *= 1000;
    hundredths = std::round(magnitude / scale * 100);
  }
  std::string out(hundredths > 0 ? sign : "");
  if (hundredths < 1e18) {
    out += FormatHundredths(static_cast<uint64_t>(hundredths), kNames[unit]);
  } else {  // Beyond any real rate; keep it readable rather than exact.
    char number[32];
    std::snprintf(number, sizeof number, "%.3g", magnitude / scale);
    out += number;
    out += kNames[unit];
  }
  out += "/s";
  return out;
}

}  // namespace strata
