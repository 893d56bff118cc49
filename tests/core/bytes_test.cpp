// Tests for strata/core/bytes.h.

#include "strata/core/bytes.h"

#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace strata {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// Parses text that must be valid.
uint64_t MustParse(const std::string& text) {
  Result<uint64_t> parsed = ParseBytes(text);
  EXPECT_TRUE(parsed.ok()) << "\"" << text << "\": " << parsed.status().ToString();
  return parsed.ok() ? *parsed : ~uint64_t{0};
}

// Checks that text is rejected with an InvalidArgument that quotes it and contains `reason`.
void ExpectRejected(const std::string& text, const std::string& reason) {
  SCOPED_TRACE("text \"" + text + "\"");
  Result<uint64_t> parsed = ParseBytes(text);
  ASSERT_FALSE(parsed.ok()) << "parsed as " << *parsed;
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  const std::string message = parsed.status().message();
  EXPECT_NE(message.find("invalid byte size \"" + text + "\""), std::string::npos) << message;
  EXPECT_NE(message.find(reason), std::string::npos) << message;
}

TEST(BytesTest, Constants) {
  EXPECT_EQ(kKiB, 1024u);
  EXPECT_EQ(kMiB, 1024u * 1024);
  EXPECT_EQ(kGiB, 1024u * 1024 * 1024);
  EXPECT_EQ(kTiB, 1024 * kGiB);
}

TEST(BytesTest, HeaderExamples) {
  EXPECT_EQ(MustParse("64MiB"), 64 * kMiB);
  EXPECT_EQ(MustParse("1.5GiB"), 1610612736u);
  EXPECT_EQ(MustParse("1e9"), 1000000000u);
  EXPECT_EQ(MustParse("4096"), 4096u);
  EXPECT_EQ(FormatBytes(67108864), "64MiB");
  EXPECT_EQ(FormatBytes(1610612736), "1.5GiB");
  EXPECT_EQ(FormatBytes(1000), "1000B");
  EXPECT_EQ(FormatBandwidth(2.1e9), "2.1GB/s");
  ExpectRejected("1.5B", "whole number of bytes");
  ExpectRejected("-1MiB", "negative");
}

TEST(BytesTest, ParsesEveryUnitCaseInsensitivelyWithOptionalSpace) {
  const struct {
    const char* unit;
    uint64_t bytes;
  } units[] = {
      {"", 1},      {"B", 1},      {"K", kKiB},           {"Ki", kKiB},       {"KiB", kKiB},
      {"KB", 1000}, {"M", kMiB},   {"Mi", kMiB},          {"MiB", kMiB},      {"MB", 1000000},
      {"G", kGiB},  {"Gi", kGiB},  {"GiB", kGiB},         {"GB", 1000000000}, {"T", kTiB},
      {"Ti", kTiB}, {"TiB", kTiB}, {"TB", 1000000000000},
  };
  for (const auto& u : units) {
    std::string lower = u.unit;
    std::string upper = u.unit;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    for (const std::string& unit : {std::string(u.unit), lower, upper}) {
      EXPECT_EQ(MustParse("3" + unit), 3 * u.bytes) << unit;
      EXPECT_EQ(MustParse("3 " + unit), 3 * u.bytes) << unit;
      EXPECT_EQ(MustParse("\t 3\t" + unit + " "), 3 * u.bytes) << unit;
    }
  }
}

TEST(BytesTest, ParsesDecimalAndScientificNumbersExactly) {
  EXPECT_EQ(MustParse("0"), 0u);
  EXPECT_EQ(MustParse("0.0"), 0u);
  EXPECT_EQ(MustParse("0GiB"), 0u);
  EXPECT_EQ(MustParse("0e999999999"), 0u);
  EXPECT_EQ(MustParse("000123"), 123u);
  EXPECT_EQ(MustParse(".5KiB"), 512u);
  EXPECT_EQ(MustParse("5.KiB"), 5120u);
  EXPECT_EQ(MustParse("0.25MiB"), 262144u);
  EXPECT_EQ(MustParse("1.25e3"), 1250u);
  EXPECT_EQ(MustParse("1E3"), 1000u);
  EXPECT_EQ(MustParse("1e+3"), 1000u);
  EXPECT_EQ(MustParse("25e-1KiB"), 2560u);
  EXPECT_EQ(MustParse("1e-3KB"), 1u);
  EXPECT_EQ(MustParse("0.001KB"), 1u);
  EXPECT_EQ(MustParse("1.000000000000000000000000000000"), 1u);
  EXPECT_EQ(MustParse("0.0009765625KiB"), 1u);                                // 2^-10 KiB.
  EXPECT_EQ(MustParse("0.0000000000009094947017729282379150390625TiB"), 1u);  // 2^-40 TiB.
  EXPECT_EQ(MustParse("2.5e-1KiB"), 256u);
  EXPECT_EQ(MustParse("1e19"), 10000000000000000000u);
  EXPECT_EQ(MustParse("18446744073709551615"), kMax);
  EXPECT_EQ(MustParse("18446744073709551615.000"), kMax);
  EXPECT_EQ(MustParse("16777215TiB"), 16777215 * kTiB);
  EXPECT_EQ(MustParse("17179869183.75GiB"), 17179869183 * kGiB + 3 * kGiB / 4);
  EXPECT_EQ(MustParse("18.446744073709551615e18"), kMax);
}

TEST(BytesTest, RejectsEmptyAndMalformedText) {
  const std::string accepted = "with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB";
  ExpectRejected("", "empty");
  ExpectRejected("   ", "empty");
  for (const char* text : {"12XB", "MiB", ".", "e9", "1e", "1e+", "1.2.3", "1 2", "1,000", "0x10",
                           "+5", "1e1.5", "5 MiB B", "5iB", "5KiBs", "1PiB", "1EiB", "12 XB"}) {
    ExpectRejected(text, accepted);
  }
}

TEST(BytesTest, RejectsNanAndInfinity) {
  for (const char* text : {"nan", "NaN", "inf", "Infinity", "infKiB"}) {
    ExpectRejected(text, "expected a non-negative number");
  }
  ExpectRejected("-inf", "negative");
}

TEST(BytesTest, RejectsNegativeSizes) {
  for (const char* text : {"-1", "-1MiB", "-0", " -5 KB", "-0.5"}) ExpectRejected(text, "negative");
}

TEST(BytesTest, RejectsFractionsOfAByte) {
  for (const char* text : {"1.5", "1.5B", "0.1", "1e-1", "0.3KiB", "1.0001KB", "1e-999999999",
                           "1.33KiB", "0.0000000000000000001TiB"}) {
    ExpectRejected(text, "not a whole number of bytes");
  }
}

TEST(BytesTest, RejectsSizesBeyond64Bits) {
  for (const char* text : {"18446744073709551616", "18446744073709551615.5e1", "2e19",
                           "16777216TiB", "18446744073709552KB", "1e999999999", "99999999999TB"}) {
    ExpectRejected(text, "larger than the largest size");
  }
  ExpectRejected("1234567890123456789012345678901234567", "significant digits");
}

TEST(BytesTest, FormatsWithTheLargestBinaryUnit) {
  EXPECT_EQ(FormatBytes(0), "0B");
  EXPECT_EQ(FormatBytes(1), "1B");
  EXPECT_EQ(FormatBytes(1023), "1023B");
  EXPECT_EQ(FormatBytes(1024), "1KiB");
  EXPECT_EQ(FormatBytes(1536), "1.5KiB");
  EXPECT_EQ(FormatBytes(1280), "1.25KiB");
  EXPECT_EQ(FormatBytes(1100), "1.07KiB");   // 1.0742...
  EXPECT_EQ(FormatBytes(1029), "1KiB");      // 1.0048... rounds to 1.00.
  EXPECT_EQ(FormatBytes(1030), "1.01KiB");   // 1.0058...
  EXPECT_EQ(FormatBytes(kMiB - 1), "1MiB");  // 1023.999KiB would round to 1024KiB.
  EXPECT_EQ(FormatBytes(1023 * kMiB), "1023MiB");
  EXPECT_EQ(FormatBytes(5 * kGiB / 4), "1.25GiB");
  EXPECT_EQ(FormatBytes(kTiB), "1TiB");
  EXPECT_EQ(FormatBytes(1024 * kTiB), "1024TiB");  // TiB is the largest unit.
  EXPECT_EQ(FormatBytes(kMax), "16777216TiB");
}

// FormatBytes keeps two decimals, so parsing its output gives the value back exactly when the
// value is a whole number of hundredths of its unit that is also a whole number of bytes, and
// otherwise either a nearby value or a "not a whole number of bytes" error (1.07KiB).
TEST(BytesTest, FormatThenParseRoundTrips) {
  std::vector<uint64_t> values;
  for (uint64_t v = 0; v < 5000; ++v) values.push_back(v);
  for (int shift = 10; shift <= 63; ++shift) {
    const uint64_t power = uint64_t{1} << shift;
    for (uint64_t v : {power - 1, power, power + 1, power / 4 * 3, power + power / 2}) {
      values.push_back(v);
    }
  }
  uint64_t state = 12345;
  for (int i = 0; i < 100000; ++i) {
    state = state * 6364136223846793005u + 1442695040888963407u;
    values.push_back(state >> (state % 64));  // Spread over all magnitudes.
  }
  uint64_t exact = 0;
  for (uint64_t v : values) {
    const std::string text = FormatBytes(v);
    SCOPED_TRACE("value " + std::to_string(v) + " formatted as \"" + text + "\"");
    const size_t unit_start = text.find_first_not_of("0123456789.");
    ASSERT_NE(unit_start, std::string::npos);
    const std::string unit = text.substr(unit_start);
    const uint64_t unit_bytes = unit == "B"     ? 1
                                : unit == "KiB" ? kKiB
                                : unit == "MiB" ? kMiB
                                : unit == "GiB" ? kGiB
                                                : kTiB;
    ASSERT_TRUE(unit == "B" || unit == "KiB" || unit == "MiB" || unit == "GiB" || unit == "TiB");
    const double number = std::stod(text.substr(0, unit_start));
    EXPECT_GE(number, 1.0 * (v != 0));
    if (unit != "TiB") {
      EXPECT_LT(number, 1024.0);
    }

    Result<uint64_t> parsed = ParseBytes(text);
    if (!parsed.ok()) {
      const std::string message = parsed.status().message();
      if (v > kMax - kTiB / 200) {  // Rounds up to 16777216TiB = 2^64.
        EXPECT_NE(message.find("larger than"), std::string::npos) << message;
      } else {
        EXPECT_NE(message.find("not a whole number"), std::string::npos) << message;
      }
      continue;
    }
    const uint64_t back = *parsed;
    const uint64_t error = back > v ? back - v : v - back;
    EXPECT_LE(error, unit_bytes / 200) << "parsed back as " << back;
    // Whole hundredths of a unit, whole bytes (any multiple of a quarter unit, for example).
    if (unit_bytes == 1 || v % (unit_bytes / 4) == 0) {
      EXPECT_EQ(back, v);
    }
    exact += back == v;
  }
  EXPECT_GT(exact, 5000u);
}

TEST(BytesTest, FormatsBandwidthInDecimalUnits) {
  EXPECT_EQ(FormatBandwidth(0), "0B/s");
  EXPECT_EQ(FormatBandwidth(0.5), "0.5B/s");
  EXPECT_EQ(FormatBandwidth(999), "999B/s");
  EXPECT_EQ(FormatBandwidth(1000), "1KB/s");
  EXPECT_EQ(FormatBandwidth(1024), "1.02KB/s");
  EXPECT_EQ(FormatBandwidth(999999), "1MB/s");  // Not "1000KB/s".
  EXPECT_EQ(FormatBandwidth(12.346e6), "12.35MB/s");
  EXPECT_EQ(FormatBandwidth(2.1e9), "2.1GB/s");
  EXPECT_EQ(FormatBandwidth(25e9), "25GB/s");
  EXPECT_EQ(FormatBandwidth(1.5e12), "1.5TB/s");
  EXPECT_EQ(FormatBandwidth(5e15), "5000TB/s");  // TB is the largest unit.
  EXPECT_EQ(FormatBandwidth(-2e9), "-2GB/s");
  EXPECT_EQ(FormatBandwidth(-0.001), "0B/s");
  EXPECT_EQ(FormatBandwidth(std::numeric_limits<double>::infinity()), "infB/s");
  EXPECT_EQ(FormatBandwidth(std::nan("")), "nanB/s");
  EXPECT_EQ(FormatBandwidth(1e300), "1e+288TB/s");
}

TEST(BytesTest, AlignUp) {
  static_assert(AlignUp(0, 4096) == 0);
  static_assert(AlignUp(1, 4096) == 4096);
  EXPECT_EQ(AlignUp(4095, 4096), 4096u);
  EXPECT_EQ(AlignUp(4096, 4096), 4096u);
  EXPECT_EQ(AlignUp(4097, 4096), 8192u);
  EXPECT_EQ(AlignUp(7, 1), 7u);
  EXPECT_EQ(AlignUp(5, 2), 6u);
  EXPECT_EQ(AlignUp(3 * kGiB + 1, kGiB), 4 * kGiB);
  EXPECT_EQ(AlignUp(kMax - 4095, 4096), kMax - 4095);
}

}  // namespace
}  // namespace strata
