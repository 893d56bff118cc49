#include "strata/offload/local_communicator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "strata/core/dtype.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

enum class Kind : int { kAllReduce, kReduceScatter, kAllGather, kAllToAll, kScalars };

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kAllReduce: return "all-reduce";
    case Kind::kReduceScatter: return "reduce-scatter";
    case Kind::kAllGather: return "all-gather";
    case Kind::kAllToAll: return "all-to-all";
    case Kind::kScalars: return "all-reduce of step scalars";
  }
  return "collective";
}

/// One rank's part in a collective. `count`: the elements of an all-reduce, per rank of a
/// reduce-scatter's output, an all-gather's input and an all-to-all's blocks.
struct Contribution {
  Kind kind = Kind::kAllReduce;
  DType dtype = DType::kFp32;
  ReduceOp op = ReduceOp::kSum;
  size_t count = 0;
  const void* send = nullptr;
  void* recv = nullptr;

  std::string Describe() const {
    std::string text = std::string(KindName(kind)) + " of " + std::to_string(count) + " ";
    text += kind == Kind::kScalars ? std::string("doubles") : std::string(DTypeName(dtype));
    if (reduces()) text += op == ReduceOp::kSum ? " (sum)" : " (max)";
    return text;
  }
  bool reduces() const { return kind != Kind::kAllGather && kind != Kind::kAllToAll; }
  bool Matches(const Contribution& other) const {
    return kind == other.kind && count == other.count &&
           (kind == Kind::kScalars || dtype == other.dtype) && (!reduces() || op == other.op);
  }
};

/// The ranks' meeting at one position of their collective sequences.
struct Round {
  std::vector<std::optional<Contribution>> parts;
  int arrived = 0;
  int computed = 0;  // Ranks that have read every input: outputs may be written.
  int finished = 0;
  Status failed;  // Set once: every rank that comes (or waits) reports it.
};

struct Group {
  int size = 1;
  double timeout_seconds = 0;
  std::mutex mutex;
  std::condition_variable changed;
  std::map<uint64_t, Round> rounds;  // By position in the sequence (from 1).
  std::vector<bool> left;            // Ranks whose communicator was destroyed.
};

/// Element `i` of `data` (of `dtype`) widened to double.
double Load(const void* data, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kFp32: return static_cast<const float*>(data)[i];
    case DType::kFp16: return Fp16ToFp32(static_cast<const uint16_t*>(data)[i]);
    case DType::kBf16: return Bf16ToFp32(static_cast<const uint16_t*>(data)[i]);
  }
  return 0.0;
}

/// Rounds `value` into element `i` of `data`: in fp32 first, as the sum is kept in fp32.
void Store(void* data, DType dtype, size_t i, double value) {
  const float narrow = static_cast<float>(value);
  switch (dtype) {
    case DType::kFp32: static_cast<float*>(data)[i] = narrow; return;
    case DType::kFp16: static_cast<uint16_t*>(data)[i] = Fp32ToFp16(narrow); return;
    case DType::kBf16: static_cast<uint16_t*>(data)[i] = Fp32ToBf16(narrow); return;
  }
}

/// This rank's output of a collective whose every input is in `parts`, into `out` (as many
/// bytes as recv takes). Reductions run in rank order, in fp32 (double for scalars), rounded
/// once at the end: the same result on every rank.
void Compute(const std::vector<std::optional<Contribution>>& parts, int rank, std::byte* out) {
  const Contribution& mine = *parts[size_t(rank)];
  const int size = int(parts.size());
  if (mine.kind == Kind::kAllGather || mine.kind == Kind::kAllToAll) {
    // An all-to-all takes this rank's block of every rank's send buffer.
    const size_t bytes = mine.count * DTypeSize(mine.dtype);
    const size_t from = mine.kind == Kind::kAllToAll ? size_t(rank) * bytes : 0;
    for (int r = 0; r < size; ++r) {
      std::memcpy(out + size_t(r) * bytes,
                  static_cast<const std::byte*>(parts[size_t(r)]->send) + from, bytes);
    }
    return;
  }
  // The first input element of this rank's output in every rank's send buffer.
  const size_t first = mine.kind == Kind::kReduceScatter ? size_t(rank) * mine.count : 0;
  for (size_t i = 0; i < mine.count; ++i) {
    double acc = 0.0;
    for (int r = 0; r < size; ++r) {
      const void* send = parts[size_t(r)]->send;
      double value = 0.0;
      if (mine.kind == Kind::kScalars) {
        value = static_cast<const double*>(send)[i];
      } else {
        value = Load(send, mine.dtype, first + i);
      }
      if (r == 0) {
        acc = value;
      } else if (mine.op == ReduceOp::kSum) {
        // fp32 accumulation for tensors, as NCCL and MPI sum fp32 buffers.
        acc = mine.kind == Kind::kScalars ? acc + value : double(float(acc) + float(value));
      } else {
        acc = std::max(acc, value);
      }
    }
    if (mine.kind == Kind::kScalars) {
      reinterpret_cast<double*>(out)[i] = acc;
    } else {
      Store(out, mine.dtype, i, acc);
    }
  }
}

size_t OutputBytes(const Contribution& part, int size) {
  if (part.kind == Kind::kScalars) return part.count * sizeof(double);
  const size_t per_rank = part.count * DTypeSize(part.dtype);
  return part.reduces() ? per_rank : per_rank * size_t(size);
}

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<Group> group, int rank)
      : group_(std::move(group)), rank_(rank), thread_([this] { Main(); }) {}

  ~LocalCommunicator() override {
    {
      // Peers waiting for this rank fail at once; its own collectives still queued fail too.
      std::lock_guard lock(group_->mutex);
      group_->left[size_t(rank_)] = true;
      group_->changed.notify_all();
    }
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      wake_.notify_one();
    }
    thread_.join();
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size; }

  void AllReduce(void* data, size_t count, DType dtype, ReduceOp op, CollectiveReady ready,
                 CollectiveDone done) override {
    Enqueue({Kind::kAllReduce, dtype, op, count, data, data}, std::move(ready), std::move(done));
  }
  void ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op,
                     CollectiveReady ready, CollectiveDone done) override {
    Enqueue({Kind::kReduceScatter, dtype, op, recv_count, send, recv}, std::move(ready),
            std::move(done));
  }
  void AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                 CollectiveReady ready, CollectiveDone done) override {
    Enqueue({Kind::kAllGather, dtype, ReduceOp::kSum, send_count, send, recv}, std::move(ready),
            std::move(done));
  }
  void AllToAll(const void* send, void* recv, size_t count, DType dtype, CollectiveReady ready,
                CollectiveDone done) override {
    Enqueue({Kind::kAllToAll, dtype, ReduceOp::kSum, count, send, recv}, std::move(ready),
            std::move(done));
  }
  void AllReduceScalars(std::span<double> values, ReduceOp op, CollectiveReady ready,
                        CollectiveDone done) override {
    Enqueue({Kind::kScalars, DType::kFp32, op, values.size(), values.data(), values.data()},
            std::move(ready), std::move(done));
  }

 private:
  struct Job {
    uint64_t number;
    Contribution part;
    CollectiveReady ready;
    CollectiveDone done;
  };

  void Enqueue(Contribution part, CollectiveReady ready, CollectiveDone done) {
    std::lock_guard lock(mutex_);
    jobs_.push_back({++enqueued_, part, std::move(ready), std::move(done)});
    wake_.notify_one();
  }

  void Main() {
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      Status status = failed_;
      if (status.ok() && job.ready) {
        try {
          status = job.ready();
        } catch (const std::exception& e) {
          status = Internal(Name(job.number, job.part) + ": its ready function threw: " + e.what());
        }
      }
      status = Run(job.number, job.part, std::move(status));
      if (!status.ok() && failed_.ok()) failed_ = status;
      if (!job.done) continue;
      try {
        job.done(std::move(status));
      } catch (...) {
        // Nothing to tell: the callback's own failure is its owner's to report.
      }
    }
  }

  std::string Name(uint64_t number, const Contribution& part) const {
    return "rank " + std::to_string(rank_) + " of " + std::to_string(group_->size) +
           ": collective #" + std::to_string(number) + " (" + part.Describe() + ")";
  }

  /// Meets the other ranks at position `number`. `input`: this rank's input failed (its ready
  /// function, or an earlier collective): the round fails on every rank, without waiting.
  Status Run(uint64_t number, const Contribution& part, Status input) {
    Group& g = *group_;
    std::unique_lock lock(g.mutex);
    Round& round = g.rounds[number];
    if (round.parts.empty()) round.parts.resize(size_t(g.size));
    auto finish = [&](Status status) {
      if (++round.finished == g.size) g.rounds.erase(number);
      return status;
    };
    if (!input.ok()) {
      if (round.failed.ok()) {
        round.failed =
            Unavailable("rank " + std::to_string(rank_) + " could not join collective #" +
                        std::to_string(number) + ": " + input.message());
      }
      g.changed.notify_all();
      return finish(input);
    }
    round.parts[size_t(rank_)] = part;
    ++round.arrived;
    g.changed.notify_all();

    // Every rank's input, or a failure.
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(g.timeout_seconds));
    auto missing = [&] {
      std::string ranks;
      for (int r = 0; r < g.size; ++r) {
        if (!round.parts[size_t(r)]) ranks += " " + std::to_string(r);
      }
      return ranks;
    };
    for (;;) {
      if (!round.failed.ok()) return finish(round.failed);
      if (round.arrived == g.size) break;
      if (g.left[size_t(rank_)]) {
        round.failed = Unavailable(Name(number, part) +
                                   ": the communicator was destroyed while "
                                   "rank(s)" +
                                   missing() + " had not joined");
        continue;
      }
      for (int r = 0; r < g.size; ++r) {
        if (g.left[size_t(r)] && !round.parts[size_t(r)]) {
          round.failed = Unavailable(Name(number, part) + ": rank " + std::to_string(r) +
                                     " left the group before joining it");
        }
      }
      if (!round.failed.ok()) continue;
      if (g.changed.wait_until(lock, deadline) == std::cv_status::timeout &&
          round.arrived < g.size && round.failed.ok()) {
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, "%g s", g.timeout_seconds);
        round.failed = Unavailable(Name(number, part) + " waited " + seconds + " for rank(s)" +
                                   missing() + "; a peer died or stopped enqueueing");
      }
    }
    for (int r = 0; r < g.size; ++r) {
      const Contribution& other = *round.parts[size_t(r)];
      if (!other.Matches(part)) {
        // Every rank reaches the same verdict from the same parts; none reads a buffer.
        return finish(InvalidArgument(Name(number, part) + " meets rank " + std::to_string(r) +
                                      "'s " + other.Describe() +
                                      ": the ranks enqueued different collectives"));
      }
    }

    // Read every input, then (once every rank has read) write the output: an in-place
    // all-reduce's buffer is another rank's input until then.
    std::vector<std::byte> out(OutputBytes(part, g.size));
    lock.unlock();
    Compute(round.parts, rank_, out.data());
    lock.lock();
    ++round.computed;
    g.changed.notify_all();
    g.changed.wait(lock, [&] { return round.computed == g.size; });
    lock.unlock();
    if (!out.empty()) std::memcpy(part.recv, out.data(), out.size());
    lock.lock();
    return finish(Status());
  }

  std::shared_ptr<Group> group_;
  const int rank_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job> jobs_;
  uint64_t enqueued_ = 0;
  bool stopping_ = false;
  Status failed_;       // Worker thread: the first failure, which every later collective reports.
  std::thread thread_;  // Last: started once everything it uses exists.
};

}  // namespace

Result<std::vector<std::unique_ptr<Communicator>>> CreateLocalCommunicators(
    const LocalCommunicatorOptions& options) {
  if (options.size < 1) return InvalidArgument("a group needs at least one rank");
  if (!(options.timeout_seconds > 0) || !std::isfinite(options.timeout_seconds)) {
    return InvalidArgument("the collective timeout must be a number of seconds > 0");
  }
  auto group = std::make_shared<Group>();
  group->size = options.size;
  group->timeout_seconds = options.timeout_seconds;
  group->left.assign(size_t(options.size), false);
  std::vector<std::unique_ptr<Communicator>> ranks;
  for (int r = 0; r < options.size; ++r) {
    ranks.push_back(std::make_unique<LocalCommunicator>(group, r));
  }
  return ranks;
}

}  // namespace strata::offload
