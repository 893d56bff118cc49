// Tests for strata/core/tier.h.

#include "strata/core/tier.h"

#include <gtest/gtest.h>

#include <string>

namespace strata {
namespace {

TEST(TierTest, Names) {
  EXPECT_EQ(TierName(Tier::kDevice), "device");
  EXPECT_EQ(TierName(Tier::kHost), "host");
  EXPECT_EQ(TierName(Tier::kNvme), "nvme");
  EXPECT_EQ(kTierCount, 3);
}

TEST(TierTest, NamesParseBack) {
  for (int i = 0; i < kTierCount; ++i) {
    const Tier tier = static_cast<Tier>(i);
    Result<Tier> parsed = ParseTier(TierName(tier));
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(*parsed, tier);
  }
}

TEST(TierTest, ParsesAliasesCaseInsensitively) {
  const struct {
    const char* text;
    Tier want;
  } cases[] = {
      {"device", Tier::kDevice}, {"DEVICE", Tier::kDevice}, {"gpu", Tier::kDevice},
      {"GPU", Tier::kDevice},    {"cuda", Tier::kDevice},   {"Cuda", Tier::kDevice},
      {"none", Tier::kDevice},   {"host", Tier::kHost},     {"Host", Tier::kHost},
      {"cpu", Tier::kHost},      {"CPU", Tier::kHost},      {"nvme", Tier::kNvme},
      {"NVMe", Tier::kNvme},
  };
  for (const auto& c : cases) {
    Result<Tier> parsed = ParseTier(c.text);
    ASSERT_TRUE(parsed.ok()) << c.text << ": " << parsed.status().ToString();
    EXPECT_EQ(*parsed, c.want) << c.text;
  }
}

TEST(TierTest, RejectsUnknownNamesAndQuotesThem) {
  for (const char* text : {"disk", "", "ssd", " host", "nvme0", "dram"}) {
    Result<Tier> parsed = ParseTier(text);
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    const std::string message = parsed.status().message();
    EXPECT_NE(message.find("unknown tier \"" + std::string(text) + "\""), std::string::npos)
        << message;
    for (const char* accepted : {"device", "host", "nvme", "cpu", "gpu"}) {
      EXPECT_NE(message.find(accepted), std::string::npos) << message;
    }
  }
}

}  // namespace
}  // namespace strata
