#include "strata/core/metrics.h"

#include <algorithm>
#include <cassert>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace strata {
namespace {

// Reports a programming error: prints what and on what, then fails an assert. Returns `ok` so
// NDEBUG builds can take a safe fallback path.
bool Expect(bool ok, const char* what, std::string_view subject) {
  if (!ok) {
    std::fprintf(stderr, "strata metrics: %s: '%.*s'\n", what, static_cast<int>(subject.size()),
                 subject.data());
    assert(false && "strata metrics misuse; see the message above");
  }
  return ok;
}

bool IsAsciiLetter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsAsciiDigit(char c) { return c >= '0' && c <= '9'; }

// [a-zA-Z_:][a-zA-Z0-9_:]*
bool IsValidMetricName(std::string_view name) {
  if (name.empty() || IsAsciiDigit(name[0])) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return IsAsciiLetter(c) || IsAsciiDigit(c) || c == '_' || c == ':';
  });
}

// [a-zA-Z_][a-zA-Z0-9_]*, and not starting with "__" (reserved for Prometheus' own use).
bool IsValidLabelName(std::string_view name) {
  if (name.empty() || IsAsciiDigit(name[0]) || name.starts_with("__")) return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return IsAsciiLetter(c) || IsAsciiDigit(c) || c == '_'; });
}

// Validates `labels` and returns them sorted by name, the form used as a series key. Returns
// false (after asserting) on an invalid, reserved or repeated name.
bool CanonicalLabels(const Labels& labels, bool is_histogram, Labels* canonical) {
  *canonical = labels;
  std::sort(canonical->begin(), canonical->end());
  for (size_t i = 0; i < canonical->size(); ++i) {
    const std::string& name = (*canonical)[i].first;
    if (!Expect(IsValidLabelName(name), "invalid label name", name)) return false;
    if (!Expect(!(is_histogram && name == "le"), "label name reserved for histograms", name)) {
      return false;
    }
    if (!Expect(i == 0 || (*canonical)[i - 1].first != name, "repeated label name", name)) {
      return false;
    }
  }
  return true;
}

// Drops a trailing +Inf. Returns false if the rest is not strictly increasing or holds NaN or
// +Inf; `bounds` is then sorted, deduplicated and stripped of NaN and +Inf so it is still usable.
bool NormalizeBounds(std::vector<double>* bounds) {
  if (!bounds->empty() && bounds->back() == INFINITY) bounds->pop_back();
  bool valid = true;
  for (size_t i = 0; i < bounds->size(); ++i) {
    double b = (*bounds)[i];
    if (std::isnan(b) || b == INFINITY || (i > 0 && !((*bounds)[i - 1] < b))) valid = false;
  }
  if (!valid) {
    std::erase_if(*bounds, [](double b) { return std::isnan(b) || b == INFINITY; });
    std::sort(bounds->begin(), bounds->end());
    bounds->erase(std::unique(bounds->begin(), bounds->end()), bounds->end());
  }
  return valid;
}

// Prometheus number syntax: integers exactly ("1048576", not "1.048576e+06"), other values as the
// shortest text that reads back to the same double, and "+Inf", "-Inf", "NaN".
void AppendNumber(std::string& out, double value) {
  if (std::isnan(value)) {
    out += "NaN";
  } else if (std::isinf(value)) {
    out += value > 0 ? "+Inf" : "-Inf";
  } else if (value == std::trunc(value) && std::fabs(value) <= 9007199254740992.0) {  // 2^53
    out += std::to_string(static_cast<int64_t>(value));  // Also turns -0 into "0".
  } else {
    char buffer[32];
    auto [end, ec] =
        std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::general);
    assert(ec == std::errc());
    out.append(buffer, end);
  }
}

// Label values escape backslash, double quote and newline; HELP text only backslash and newline.
void AppendEscaped(std::string& out, std::string_view text, bool escape_quote) {
  for (char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && escape_quote) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
}

// Appends `a="x",b="y"` (no braces).
void AppendLabelPairs(std::string& out, const Labels& labels) {
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i > 0) out += ',';
    out += labels[i].first;
    out += "=\"";
    AppendEscaped(out, labels[i].second, /*escape_quote=*/true);
    out += '"';
  }
}

// Appends `name{labels} value\n`, or `name value\n` without labels.
void AppendSample(std::string& out, std::string_view name, const Labels& labels, double value) {
  out += name;
  if (!labels.empty()) {
    out += '{';
    AppendLabelPairs(out, labels);
    out += '}';
  }
  out += ' ';
  AppendNumber(out, value);
  out += '\n';
}

void AppendHistogramSamples(std::string& out, std::string_view name, const Labels& labels,
                            const Histogram& histogram) {
  HistogramSnapshot snapshot = histogram.Snapshot();
  std::string label_prefix;
  AppendLabelPairs(label_prefix, labels);
  if (!label_prefix.empty()) label_prefix += ',';
  for (size_t i = 0; i < snapshot.cumulative_counts.size(); ++i) {
    out += name;
    out += "_bucket{";
    out += label_prefix;
    out += "le=\"";
    AppendNumber(out, i < snapshot.upper_bounds.size() ? snapshot.upper_bounds[i] : INFINITY);
    out += "\"} ";
    out += std::to_string(snapshot.cumulative_counts[i]);
    out += '\n';
  }
  AppendSample(out, std::string(name) + "_sum", labels, snapshot.sum);
  AppendSample(out, std::string(name) + "_count", labels, static_cast<double>(snapshot.count));
}

}  // namespace

Labels TierPairLabels(Tier from, Tier to) {
  return {{"from", std::string(TierName(from))}, {"to", std::string(TierName(to))}};
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> bounds;
  if (!Expect(start > 0 && factor > 1 && count >= 1,
              "ExponentialBuckets needs start > 0, "
              "factor > 1 and count >= 1",
              "")) {
    return bounds;
  }
  bounds.reserve(static_cast<size_t>(count));
  double bound = start;
  for (int i = 0; i < count; ++i) {
    bounds.push_back(bound);
    bound *= factor;
  }
  return bounds;
}

std::vector<double> ByteSizeBuckets() { return ExponentialBuckets(4096, 4, 10); }

std::vector<double> LatencyBuckets() {
  return {1e-5,  2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01,
          0.025, 0.05,   0.1,  0.25, 0.5,    1,    2.5,  5,      10};
}

void Counter::Increment(double amount) {
  if (!(amount >= 0)) {  // Also catches NaN.
    Expect(false, "counter increment must be >= 0, got", std::to_string(amount));
    return;
  }
  value_.fetch_add(amount, std::memory_order_relaxed);
}

Histogram::Histogram(std::vector<double> upper_bounds) : upper_bounds_(std::move(upper_bounds)) {
  Expect(NormalizeBounds(&upper_bounds_), "histogram bounds must be strictly increasing, not NaN",
         "");
  bucket_counts_ = std::make_unique<std::atomic<uint64_t>[]>(upper_bounds_.size() + 1);
}

void Histogram::Observe(double value) {
  size_t bucket = upper_bounds_.size();  // +Inf, also where NaN goes.
  if (!std::isnan(value)) {
    bucket =
        static_cast<size_t>(std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) -
                            upper_bounds_.begin());
  }
  bucket_counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

HistogramSnapshot Histogram::Snapshot() const {
  HistogramSnapshot snapshot;
  snapshot.upper_bounds = upper_bounds_;
  snapshot.cumulative_counts.resize(upper_bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) {
    total += bucket_counts_[i].load(std::memory_order_relaxed);
    snapshot.cumulative_counts[i] = total;
  }
  snapshot.count = total;
  snapshot.sum = sum_.load(std::memory_order_relaxed);
  return snapshot;
}

MetricsRegistry::MetricsRegistry() : detached_histogram_({}) {}
MetricsRegistry::~MetricsRegistry() = default;

template <typename M>
MetricsRegistry::Family* MetricsRegistry::FindOrCreateFamily(std::string_view name,
                                                             std::string_view help) {
  if (!Expect(IsValidMetricName(name), "invalid metric name", name)) return nullptr;
  auto it = families_.find(name);
  if (it == families_.end()) {
    Family family;
    family.help = std::string(help);
    family.series.template emplace<SeriesMap<M>>();
    it = families_.emplace(std::string(name), std::move(family)).first;
  }
  if (!Expect(std::holds_alternative<SeriesMap<M>>(it->second.series),
              "metric name already registered with another type", name)) {
    return nullptr;
  }
  return &it->second;
}

Counter& MetricsRegistry::GetCounter(std::string_view name, std::string_view help,
                                     const Labels& labels) {
  Labels key;
  if (!CanonicalLabels(labels, /*is_histogram=*/false, &key)) return detached_counter_;
  std::lock_guard lock(mutex_);
  Family* family = FindOrCreateFamily<Counter>(name, help);
  if (family == nullptr) return detached_counter_;
  auto& slot = std::get<SeriesMap<Counter>>(family->series)[std::move(key)];
  if (slot == nullptr) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& MetricsRegistry::GetGauge(std::string_view name, std::string_view help,
                                 const Labels& labels) {
  Labels key;
  if (!CanonicalLabels(labels, /*is_histogram=*/false, &key)) return detached_gauge_;
  std::lock_guard lock(mutex_);
  Family* family = FindOrCreateFamily<Gauge>(name, help);
  if (family == nullptr) return detached_gauge_;
  auto& slot = std::get<SeriesMap<Gauge>>(family->series)[std::move(key)];
  if (slot == nullptr) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& MetricsRegistry::GetHistogram(std::string_view name, std::string_view help,
                                         std::vector<double> upper_bounds, const Labels& labels) {
  Labels key;
  if (!CanonicalLabels(labels, /*is_histogram=*/true, &key)) return detached_histogram_;
  if (!Expect(NormalizeBounds(&upper_bounds),
              "histogram bounds must be strictly increasing, not NaN", name)) {
    return detached_histogram_;
  }
  std::lock_guard lock(mutex_);
  bool is_new_family = families_.find(name) == families_.end();
  Family* family = FindOrCreateFamily<Histogram>(name, help);
  if (family == nullptr) return detached_histogram_;
  if (is_new_family) family->upper_bounds = upper_bounds;
  Expect(family->upper_bounds == upper_bounds, "histogram asked again with different bucket bounds",
         name);
  auto& slot = std::get<SeriesMap<Histogram>>(family->series)[std::move(key)];
  if (slot == nullptr) slot = std::make_unique<Histogram>(family->upper_bounds);
  return *slot;
}

std::string MetricsRegistry::RenderPrometheus() const {
  std::string out;
  std::lock_guard lock(mutex_);
  for (const auto& [name, family] : families_) {
    out += "# HELP ";
    out += name;
    if (!family.help.empty()) out += ' ';
    AppendEscaped(out, family.help, /*escape_quote=*/false);
    out += "\n# TYPE ";
    out += name;
    if (const auto* counters = std::get_if<SeriesMap<Counter>>(&family.series)) {
      out += " counter\n";
      for (const auto& [labels, counter] : *counters) {
        AppendSample(out, name, labels, counter->Value());
      }
    } else if (const auto* gauges = std::get_if<SeriesMap<Gauge>>(&family.series)) {
      out += " gauge\n";
      for (const auto& [labels, gauge] : *gauges) AppendSample(out, name, labels, gauge->Value());
    } else {
      out += " histogram\n";
      for (const auto& [labels, histogram] : std::get<SeriesMap<Histogram>>(family.series)) {
        AppendHistogramSamples(out, name, labels, *histogram);
      }
    }
  }
  return out;
}

}  // namespace strata
