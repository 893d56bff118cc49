// Metrics: counters, gauges and histograms, rendered in the Prometheus text exposition format
// (version 0.0.4).
//
// A MetricsRegistry owns every metric it hands out. Registration (Get*) takes a mutex and is
// meant for set-up paths; the returned references stay valid for the registry's lifetime, so hot
// paths keep them and update lock-free:
//
//   MetricsRegistry registry;
//   Counter& copied = registry.GetCounter("strata_copy_bytes_total", "Bytes copied between tiers.",
//                                         TierPairLabels(Tier::kHost, Tier::kDevice));
//   copied.Increment(chunk_bytes);  // from any thread
//   std::string page = registry.RenderPrometheus();
//
// Misuse (an invalid metric or label name, one name asked as two types, a negative counter
// increment, histogram bounds that are not increasing) is a programming error: it fails an
// assert in debug builds. In NDEBUG builds the call is still safe: an update is ignored and a
// registration returns a detached metric that is never rendered.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "strata/core/tier.h"

namespace strata {

/// Label name/value pairs of one series. Order does not matter: {a,b} and {b,a} name the same
/// series, and labels are rendered sorted by name. Names must match [a-zA-Z_][a-zA-Z0-9_]*, must
/// not start with "__" and must not repeat; values are any bytes (escaped when rendered).
using Labels = std::vector<std::pair<std::string, std::string>>;

/// {{"from", TierName(from)}, {"to", TierName(to)}}, e.g. from="host",to="device".
Labels TierPairLabels(Tier from, Tier to);

/// `count` upper bounds start, start*factor, start*factor^2, ... Requires start > 0, factor > 1
/// and count >= 1 (asserted; an empty vector in NDEBUG builds).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

/// Upper bounds for transfer sizes in bytes: 4 KiB, 16 KiB, ..., 1 GiB (powers of 4, 10 buckets).
std::vector<double> ByteSizeBuckets();

/// Upper bounds for latencies in seconds: 1-2.5-5 steps from 10 us to 10 s (19 buckets).
std::vector<double> LatencyBuckets();

/// A monotonically increasing value (bytes moved, operations done).
///
/// Thread safety: every method may be called from any thread; Increment is a lock-free atomic
/// add. Sums of integral amounts are exact up to 2^53.
class Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  /// Adds `amount`, which must be >= 0 (asserted; a negative or NaN amount is ignored in NDEBUG
  /// builds).
  void Increment(double amount = 1.0);

  /// The current total.
  [[nodiscard]] double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// A value that goes up and down (bytes resident in a tier, queue depth).
///
/// Thread safety: every method may be called from any thread; Set and Add are lock-free atomics.
class Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  /// Replaces the value.
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }

  /// Adds `delta` (may be negative).
  void Add(double delta) { value_.fetch_add(delta, std::memory_order_relaxed); }

  /// The current value.
  [[nodiscard]] double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// A point-in-time copy of a histogram's state.
struct HistogramSnapshot {
  std::vector<double> upper_bounds;  ///< Finite bounds, strictly increasing (+Inf is implicit).
  /// Cumulative counts: cumulative_counts[i] observations were <= upper_bounds[i]; the last
  /// element (one past the bounds) is the +Inf bucket and equals `count`.
  std::vector<uint64_t> cumulative_counts;
  double sum = 0.0;    ///< Sum of all observed values.
  uint64_t count = 0;  ///< Number of observations.
};

/// Counts observations into buckets with fixed upper bounds (inclusive: a value equal to a bound
/// falls in that bucket), and keeps their sum.
///
/// Thread safety: every method may be called from any thread; Observe is two lock-free atomic
/// adds. A snapshot taken during concurrent Observe calls may show a sum that lags or leads the
/// counts by the in-flight observations; the counts are always consistent with each other.
class Histogram {
 public:
  /// `upper_bounds` must be strictly increasing and not NaN (asserted). A trailing +Inf is
  /// dropped (the +Inf bucket always exists); an empty vector gives a single +Inf bucket.
  explicit Histogram(std::vector<double> upper_bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  /// Records one observation. NaN is counted in the +Inf bucket and makes the sum NaN, as the
  /// Prometheus client libraries do.
  void Observe(double value);

  /// The finite upper bounds.
  [[nodiscard]] const std::vector<double>& UpperBounds() const { return upper_bounds_; }

  /// Copies the current counts and sum.
  [[nodiscard]] HistogramSnapshot Snapshot() const;

 private:
  std::vector<double> upper_bounds_;
  // Per-bucket (not cumulative) counts; one more than upper_bounds_ for +Inf.
  std::unique_ptr<std::atomic<uint64_t>[]> bucket_counts_;
  std::atomic<double> sum_{0.0};
};

/// Owns named, labelled metrics and renders them for a Prometheus scrape.
///
/// A metric family is a name with a type and help text; each distinct label set under it is one
/// series. Get* returns the same object for the same name and labels.
///
/// Ownership: the registry owns every metric; references it returns stay valid until the
/// registry is destroyed. It is neither copyable nor movable.
///
/// Thread safety: all methods may be called concurrently. Get* and RenderPrometheus take an
/// internal mutex; updates through returned references do not.
class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  /// Returns the counter `name`{labels}, creating it at zero. `name` must match
  /// [a-zA-Z_:][a-zA-Z0-9_:]* and must not already name a gauge or histogram (asserted). `help`
  /// is kept from the family's first registration.
  Counter& GetCounter(std::string_view name, std::string_view help, const Labels& labels = {});

  /// Returns the gauge `name`{labels}, creating it at zero. Same rules as GetCounter.
  Gauge& GetGauge(std::string_view name, std::string_view help, const Labels& labels = {});

  /// Returns the histogram `name`{labels}, creating it empty. Same rules as GetCounter; in
  /// addition the label name "le" is reserved, and every series of a family must be asked with
  /// the same `upper_bounds` (asserted; the family's first bounds are used in NDEBUG builds).
  Histogram& GetHistogram(std::string_view name, std::string_view help,
                          std::vector<double> upper_bounds, const Labels& labels = {});

  /// Renders every metric in the Prometheus text format 0.0.4 (Content-Type
  /// "text/plain; version=0.0.4"). Families are sorted by name and series by label set, so the
  /// output does not depend on registration order. Each family has one # HELP and one # TYPE
  /// line; histograms render cumulative name_bucket{le="..."} series ending with le="+Inf",
  /// then name_sum and name_count.
  std::string RenderPrometheus() const;

 private:
  template <typename M>
  using SeriesMap = std::map<Labels, std::unique_ptr<M>>;

  struct Family {
    std::string help;
    std::vector<double> upper_bounds;  // Histogram families only.
    std::variant<SeriesMap<Counter>, SeriesMap<Gauge>, SeriesMap<Histogram>> series;
  };

  // Finds or creates the family `name` holding metrics of type M. Returns nullptr (after
  // asserting) when the name is invalid or the family holds another type. Requires mutex_.
  template <typename M>
  Family* FindOrCreateFamily(std::string_view name, std::string_view help);

  mutable std::mutex mutex_;
  std::map<std::string, Family, std::less<>> families_;
  // Returned on misuse in NDEBUG builds; never rendered.
  Counter detached_counter_;
  Gauge detached_gauge_;
  Histogram detached_histogram_;
};

}  // namespace strata
