#include "strata/core/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace strata {
namespace {

TEST(MetricsTest, TierPairLabelsNameBothEnds) {
  Labels expected = {{"from", "host"}, {"to", "device"}};
  EXPECT_EQ(TierPairLabels(Tier::kHost, Tier::kDevice), expected);
}

TEST(MetricsTest, RendersSmallRegistryExactly) {
  MetricsRegistry registry;
  // Registered out of order on purpose: families render sorted by name, series by labels.
  Gauge& resident_nvme =
      registry.GetGauge("strata_resident_bytes", "Bytes resident in a tier.", {{"tier", "nvme"}});
  Gauge& resident_host =
      registry.GetGauge("strata_resident_bytes", "Bytes resident in a tier.", {{"tier", "host"}});
  Counter& host_to_device =
      registry.GetCounter("strata_copy_bytes_total", "Bytes copied between tiers.",
                          TierPairLabels(Tier::kHost, Tier::kDevice));
  Counter& device_to_nvme =
      registry.GetCounter("strata_copy_bytes_total", "Bytes copied between tiers.",
                          TierPairLabels(Tier::kDevice, Tier::kNvme));
  Histogram& latency =
      registry.GetHistogram("strata_copy_seconds", "Time to copy one chunk.", {0.25, 0.5, 1},
                            TierPairLabels(Tier::kHost, Tier::kDevice));

  resident_nvme.Set(1.5e9);
  resident_host.Set(0.5);
  host_to_device.Increment(4096);
  host_to_device.Increment(4096);
  device_to_nvme.Increment(1048576);
  for (double seconds : {0.125, 0.5, 0.75, 4.0}) latency.Observe(seconds);

  EXPECT_EQ(registry.RenderPrometheus(),
            "# HELP strata_copy_bytes_total Bytes copied between tiers.\n"
            "# TYPE strata_copy_bytes_total counter\n"
            "strata_copy_bytes_total{from=\"device\",to=\"nvme\"} 1048576\n"
            "strata_copy_bytes_total{from=\"host\",to=\"device\"} 8192\n"
            "# HELP strata_copy_seconds Time to copy one chunk.\n"
            "# TYPE strata_copy_seconds histogram\n"
            "strata_copy_seconds_bucket{from=\"host\",to=\"device\",le=\"0.25\"} 1\n"
            "strata_copy_seconds_bucket{from=\"host\",to=\"device\",le=\"0.5\"} 2\n"
            "strata_copy_seconds_bucket{from=\"host\",to=\"device\",le=\"1\"} 3\n"
            "strata_copy_seconds_bucket{from=\"host\",to=\"device\",le=\"+Inf\"} 4\n"
            "strata_copy_seconds_sum{from=\"host\",to=\"device\"} 5.375\n"
            "strata_copy_seconds_count{from=\"host\",to=\"device\"} 4\n"
            "# HELP strata_resident_bytes Bytes resident in a tier.\n"
            "# TYPE strata_resident_bytes gauge\n"
            "strata_resident_bytes{tier=\"host\"} 0.5\n"
            "strata_resident_bytes{tier=\"nvme\"} 1500000000\n");
}

TEST(MetricsTest, RendersUnlabelledSeriesWithoutBraces) {
  MetricsRegistry registry;
  registry.GetCounter("ops_total", "").Increment(3);
  registry.GetHistogram("chunk_bytes", "Chunk sizes.", {4096});

  EXPECT_EQ(registry.RenderPrometheus(),
            "# HELP chunk_bytes Chunk sizes.\n"
            "# TYPE chunk_bytes histogram\n"
            "chunk_bytes_bucket{le=\"4096\"} 0\n"
            "chunk_bytes_bucket{le=\"+Inf\"} 0\n"
            "chunk_bytes_sum 0\n"
            "chunk_bytes_count 0\n"
            "# HELP ops_total\n"
            "# TYPE ops_total counter\n"
            "ops_total 3\n");
}

TEST(MetricsTest, EscapesLabelValuesAndHelpText) {
  MetricsRegistry registry;
  registry
      .GetGauge("path_info", "Paths with \\ and \"quotes\"\nover two lines.",
                {{"path", "C:\\swap \"a\"\nb"}})
      .Set(1);

  // HELP escapes backslash and newline but leaves double quotes alone; label values escape all
  // three.
  EXPECT_EQ(registry.RenderPrometheus(),
            "# HELP path_info Paths with \\\\ and \"quotes\"\\nover two lines.\n"
            "# TYPE path_info gauge\n"
            "path_info{path=\"C:\\\\swap \\\"a\\\"\\nb\"} 1\n");
}

TEST(MetricsTest, SameNameAndLabelsGiveSameObject) {
  MetricsRegistry registry;
  Counter& a = registry.GetCounter("x_total", "X.", {{"a", "1"}, {"b", "2"}});
  Counter& again = registry.GetCounter("x_total", "X.", {{"a", "1"}, {"b", "2"}});
  Counter& reordered = registry.GetCounter("x_total", "X.", {{"b", "2"}, {"a", "1"}});
  Counter& other_value = registry.GetCounter("x_total", "X.", {{"a", "1"}, {"b", "3"}});
  Counter& unlabelled = registry.GetCounter("x_total", "X.");
  EXPECT_EQ(&a, &again);
  EXPECT_EQ(&a, &reordered);
  EXPECT_NE(&a, &other_value);
  EXPECT_NE(&a, &unlabelled);

  Gauge& gauge = registry.GetGauge("g", "G.");
  EXPECT_EQ(&gauge, &registry.GetGauge("g", "G."));
  Histogram& histogram = registry.GetHistogram("h", "H.", {1, 2});
  EXPECT_EQ(&histogram, &registry.GetHistogram("h", "H.", {1, 2}));
  // A trailing +Inf is implicit, so it names the same bounds.
  EXPECT_EQ(&histogram,
            &registry.GetHistogram("h", "H.", {1, 2, std::numeric_limits<double>::infinity()}));
}

TEST(MetricsTest, ConcurrentUpdatesSumExactly) {
  MetricsRegistry registry;
  constexpr int kThreads = 8;
  constexpr int kIterations = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&registry] {
      // Registration races too: every thread must get the same objects.
      Counter& ops = registry.GetCounter("ops_total", "Ops.", {{"kind", "write"}});
      Counter& bytes = registry.GetCounter("bytes_total", "Bytes.");
      Gauge& in_flight = registry.GetGauge("in_flight", "In flight.");
      Histogram& sizes = registry.GetHistogram("sizes", "Sizes.", {1, 2, 3});
      for (int i = 0; i < kIterations; ++i) {
        ops.Increment();
        bytes.Increment(4096);
        in_flight.Add(1);
        in_flight.Add(-1);
        sizes.Observe(i % 4);  // 0, 1, 2, 3 in turn.
      }
    });
  }
  for (std::thread& thread : threads) thread.join();

  constexpr double kTotal = double{kThreads} * kIterations;
  EXPECT_EQ(registry.GetCounter("ops_total", "Ops.", {{"kind", "write"}}).Value(), kTotal);
  EXPECT_EQ(registry.GetCounter("bytes_total", "Bytes.").Value(), kTotal * 4096);
  EXPECT_EQ(registry.GetGauge("in_flight", "In flight.").Value(), 0);
  HistogramSnapshot snapshot = registry.GetHistogram("sizes", "Sizes.", {1, 2, 3}).Snapshot();
  const uint64_t quarter = kThreads * kIterations / 4;
  EXPECT_EQ(snapshot.cumulative_counts,
            (std::vector<uint64_t>{2 * quarter, 3 * quarter, 4 * quarter, 4 * quarter}));
  EXPECT_EQ(snapshot.count, 4 * quarter);
  EXPECT_EQ(snapshot.sum, 6.0 * quarter);
}

TEST(MetricsTest, HistogramBucketsAreCumulativeAndInclusiveAtBounds) {
  Histogram histogram({1, 2, 4});
  for (double value : {-1.0, 0.0, 1.0, std::nextafter(1.0, 2.0), 2.0, 4.0, 4.5}) {
    histogram.Observe(value);
  }
  HistogramSnapshot snapshot = histogram.Snapshot();
  EXPECT_EQ(snapshot.upper_bounds, (std::vector<double>{1, 2, 4}));
  // le=1: -1, 0, 1.  le=2: + 1.0000000000000002, 2.  le=4: + 4.  +Inf: + 4.5.
  EXPECT_EQ(snapshot.cumulative_counts, (std::vector<uint64_t>{3, 5, 6, 7}));
  EXPECT_EQ(snapshot.count, 7u);
  EXPECT_DOUBLE_EQ(snapshot.sum, 10.5 + std::nextafter(1.0, 2.0));
}

TEST(MetricsTest, HistogramWithoutBoundsHasOnlyInfBucket) {
  Histogram histogram({std::numeric_limits<double>::infinity()});
  histogram.Observe(7);
  HistogramSnapshot snapshot = histogram.Snapshot();
  EXPECT_TRUE(snapshot.upper_bounds.empty());
  EXPECT_EQ(snapshot.cumulative_counts, (std::vector<uint64_t>{1}));
  EXPECT_EQ(snapshot.sum, 7);
}

TEST(MetricsTest, RendersSpecialValuesAsPrometheusSpellsThem) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  MetricsRegistry registry;
  registry.GetGauge("g", "G.", {{"v", "nan"}}).Set(std::nan(""));
  registry.GetGauge("g", "G.", {{"v", "neg_inf"}}).Set(-kInf);
  registry.GetGauge("g", "G.", {{"v", "pos_inf"}}).Set(kInf);
  Histogram& histogram = registry.GetHistogram("h", "H.", {1});
  histogram.Observe(kInf);
  histogram.Observe(std::nan(""));  // Counted in +Inf, as the Prometheus clients do.

  EXPECT_EQ(registry.RenderPrometheus(),
            "# HELP g G.\n"
            "# TYPE g gauge\n"
            "g{v=\"nan\"} NaN\n"
            "g{v=\"neg_inf\"} -Inf\n"
            "g{v=\"pos_inf\"} +Inf\n"
            "# HELP h H.\n"
            "# TYPE h histogram\n"
            "h_bucket{le=\"1\"} 0\n"
            "h_bucket{le=\"+Inf\"} 2\n"
            "h_sum NaN\n"
            "h_count 2\n");
}

TEST(MetricsTest, FormatsNumbersWithoutNoise) {
  struct Case {
    double value;
    const char* text;
  };
  const Case cases[] = {
      {0, "0"},
      {-0.0, "0"},
      {-2, "-2"},
      {0.1, "0.1"},
      {2.5e-5, "2.5e-05"},
      {123456.789, "123456.789"},
      {1073741824, "1073741824"},
      {9007199254740992.0, "9007199254740992"},  // 2^53, the last exact integer.
      {1e20, "1e+20"},
      {-1.5e300, "-1.5e+300"},
  };
  for (const Case& c : cases) {
    MetricsRegistry registry;
    registry.GetGauge("g", "G.").Set(c.value);
    EXPECT_EQ(registry.RenderPrometheus(),
              std::string("# HELP g G.\n# TYPE g gauge\ng ") + c.text + "\n")
        << "value " << c.value;
  }
}

TEST(MetricsTest, BucketHelpers) {
  EXPECT_EQ(ExponentialBuckets(1, 2, 4), (std::vector<double>{1, 2, 4, 8}));

  std::vector<double> bytes = ByteSizeBuckets();
  ASSERT_EQ(bytes.size(), 10u);
  EXPECT_EQ(bytes.front(), 4096);
  EXPECT_EQ(bytes.back(), double{1 << 30});

  std::vector<double> latency = LatencyBuckets();
  ASSERT_EQ(latency.size(), 19u);
  EXPECT_EQ(latency.front(), 1e-5);
  EXPECT_EQ(latency.back(), 10);
  EXPECT_TRUE(std::is_sorted(latency.begin(), latency.end()));

  // Byte bounds render as plain integers.
  MetricsRegistry registry;
  registry.GetHistogram("b", "B.", ByteSizeBuckets());
  EXPECT_NE(registry.RenderPrometheus().find("b_bucket{le=\"1073741824\"} 0\n"), std::string::npos);
}

#ifndef NDEBUG
TEST(MetricsDeathTest, MisuseFailsAnAssert) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  MetricsRegistry registry;
  registry.GetCounter("taken", "A counter.");
  EXPECT_DEATH(registry.GetGauge("taken", "Now a gauge."), "another type: 'taken'");
  EXPECT_DEATH(registry.GetCounter("1st", "Bad name."), "invalid metric name: '1st'");
  EXPECT_DEATH(registry.GetCounter("has-dash", "Bad name."), "invalid metric name");
  EXPECT_DEATH(registry.GetCounter("ok", "Bad label.", {{"bad-label", "x"}}),
               "invalid label name: 'bad-label'");
  EXPECT_DEATH(registry.GetCounter("ok", "Reserved.", {{"__name", "x"}}), "invalid label name");
  EXPECT_DEATH(registry.GetCounter("ok", "Repeated.", {{"a", "x"}, {"a", "y"}}),
               "repeated label name: 'a'");
  EXPECT_DEATH(registry.GetHistogram("h", "le is ours.", {1}, {{"le", "1"}}), "reserved");
  EXPECT_DEATH(registry.GetHistogram("h", "Unsorted.", {2, 1}), "strictly increasing");
  registry.GetHistogram("h2", "H.", {1, 2});
  EXPECT_DEATH(registry.GetHistogram("h2", "H.", {1, 3}), "different bucket bounds: 'h2'");
  EXPECT_DEATH(registry.GetCounter("taken", "A counter.").Increment(-1), "must be >= 0");
}
#else
TEST(MetricsTest, MisuseIsHarmlessInReleaseBuilds) {
  MetricsRegistry registry;
  registry.GetCounter("taken", "A counter.").Increment(2);
  registry.GetGauge("taken", "Now a gauge.").Set(5);                          // Detached.
  registry.GetCounter("1st", "Bad name.").Increment();                        // Detached.
  registry.GetCounter("ok", "Bad label.", {{"bad-label", "x"}}).Increment();  // Detached.
  registry.GetCounter("taken", "A counter.").Increment(-1);                   // Ignored.
  EXPECT_EQ(registry.RenderPrometheus(),
            "# HELP taken A counter.\n"
            "# TYPE taken counter\n"
            "taken 2\n");
}
#endif

}  // namespace
}  // namespace strata
