#include "strata/core/log.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

namespace strata {
namespace {

TEST(LogTest, SinkReceivesEveryMessageWhole) {
  std::vector<std::pair<LogLevel, std::string>> seen;
  SetLogSink([&](LogLevel level, std::string_view message) {
    seen.emplace_back(level, std::string(message));
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 100; ++i) Log(LogLevel::kWarning, "thread " + std::to_string(t));
    });
  }
  for (auto& thread : threads) thread.join();
  Log(LogLevel::kError, "last");
  SetLogSink(nullptr);
  ASSERT_EQ(seen.size(), 401u);
  EXPECT_EQ(seen.back().first, LogLevel::kError);
  EXPECT_EQ(seen.back().second, "last");
  for (size_t i = 0; i + 1 < seen.size(); ++i) {
    EXPECT_EQ(seen[i].second.rfind("thread ", 0), 0u);
  }
}

}  // namespace
}  // namespace strata
