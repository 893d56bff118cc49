#include "strata/offload/local_communicator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "comm/collective_peers.h"
#include "comm/collective_queue.h"
#include "strata/core/dtype.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

/// The ranks' meeting at one position of their collective sequences.
struct Round {
  std::vector<std::optional<Collective>> parts;
  int arrived = 0;
  int computed = 0;  // Ranks that have read every input: outputs may be written.
  int finished = 0;
  Status failed;  // Set once: every rank that comes (or waits) reports it.
};

struct Group {
  int size = 1;
  int ranks_per_node = 1;
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
void Compute(const std::vector<std::optional<Collective>>& parts, int rank, std::byte* out) {
  const Collective& mine = *parts[size_t(rank)];
  const int size = int(parts.size());
  if (mine.kind == Collective::Kind::kAllGather || mine.kind == Collective::Kind::kAllToAll) {
    // An all-to-all takes this rank's block of every rank's send buffer.
    const size_t bytes = mine.count * DTypeSize(mine.dtype);
    const size_t from = mine.kind == Collective::Kind::kAllToAll ? size_t(rank) * bytes : 0;
    for (int r = 0; r < size; ++r) {
      std::memcpy(out + size_t(r) * bytes,
                  static_cast<const std::byte*>(parts[size_t(r)]->send) + from, bytes);
    }
    return;
  }
  // The first input element of this rank's output in every rank's send buffer.
  const size_t first =
      mine.kind == Collective::Kind::kReduceScatter ? size_t(rank) * mine.count : 0;
  for (size_t i = 0; i < mine.count; ++i) {
    double acc = 0.0;
    for (int r = 0; r < size; ++r) {
      const void* send = parts[size_t(r)]->send;
      double value = 0.0;
      if (mine.kind == Collective::Kind::kAllReduceScalars) {
        value = static_cast<const double*>(send)[i];
      } else {
        value = Load(send, mine.dtype, first + i);
      }
      if (r == 0) {
        acc = value;
      } else if (mine.op == ReduceOp::kSum) {
        // fp32 accumulation for tensors, as NCCL and MPI sum fp32 buffers.
        acc = mine.kind == Collective::Kind::kAllReduceScalars ? acc + value
                                                               : double(float(acc) + float(value));
      } else {
        acc = std::max(acc, value);
      }
    }
    if (mine.kind == Collective::Kind::kAllReduceScalars) {
      reinterpret_cast<double*>(out)[i] = acc;
    } else {
      Store(out, mine.dtype, i, acc);
    }
  }
}

/// One rank's end of a group: the collective at position k meets the others' k-th.
class LocalWire final : public internal::CollectiveWire {
 public:
  LocalWire(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size; }
  NodePlace node() const override {
    const int first = rank_ / group_->ranks_per_node * group_->ranks_per_node;
    return {rank_ - first, std::min(group_->ranks_per_node, group_->size - first)};
  }

  /// Peers waiting for this rank fail at once; its own collectives still queued fail too.
  void Leave() override {
    std::lock_guard lock(group_->mutex);
    group_->left[size_t(rank_)] = true;
    group_->changed.notify_all();
  }

  /// This rank's input failed (its ready function, or an earlier collective): the round fails
  /// on every rank, without waiting.
  void Skip(const internal::QueuedCollective& queued, const Status& why) override {
    Group& g = *group_;
    std::lock_guard lock(g.mutex);
    Round& round = RoundAt(queued.number);
    if (round.failed.ok()) {
      round.failed = Unavailable("rank " + std::to_string(rank_) + " could not join collective #" +
                                 std::to_string(queued.number) + ": " + why.message());
    }
    g.changed.notify_all();
    Finish(queued.number, round);
  }

  /// Meets the other ranks at the collective's position.
  Status Run(const internal::QueuedCollective& queued) override {
    Group& g = *group_;
    const Collective& part = queued.collective;
    std::unique_lock lock(g.mutex);
    Round& round = RoundAt(queued.number);
    auto finish = [&](Status status) {
      Finish(queued.number, round);
      return status;
    };
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
        round.failed = Unavailable(queued.name +
                                   ": the communicator was destroyed while "
                                   "rank(s)" +
                                   missing() + " had not joined");
        continue;
      }
      for (int r = 0; r < g.size; ++r) {
        if (g.left[size_t(r)] && !round.parts[size_t(r)]) {
          round.failed = Unavailable(queued.name + ": rank " + std::to_string(r) +
                                     " left the group before joining it");
        }
      }
      if (!round.failed.ok()) continue;
      if (g.changed.wait_until(lock, deadline) == std::cv_status::timeout &&
          round.arrived < g.size && round.failed.ok()) {
        round.failed =
            Unavailable(queued.name + " waited " + internal::FormatSeconds(g.timeout_seconds) +
                        " for rank(s)" + missing() + "; a peer died or stopped enqueueing");
      }
    }
    for (int r = 0; r < g.size; ++r) {
      const Collective& other = *round.parts[size_t(r)];
      if (!other.Matches(part)) {
        // Every rank reaches the same verdict from the same parts; none reads a buffer.
        return finish(InvalidArgument(queued.name + " meets rank " + std::to_string(r) + "'s " +
                                      other.Describe() +
                                      ": the ranks enqueued different collectives"));
      }
    }

    // Read every input, then (once every rank has read) write the output: an in-place
    // all-reduce's buffer is another rank's input until then.
    std::vector<std::byte> out(part.recv_bytes(g.size));
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

 private:
  /// The round at position `number`, made by the first rank to reach it. Group mutex held.
  Round& RoundAt(uint64_t number) {
    Round& round = group_->rounds[number];
    if (round.parts.empty()) round.parts.resize(size_t(group_->size));
    return round;
  }

  /// This rank is through with `round`; the last one out removes it. Group mutex held.
  void Finish(uint64_t number, Round& round) {
    if (++round.finished == group_->size) group_->rounds.erase(number);
  }

  const std::shared_ptr<Group> group_;
  const int rank_;
};

}  // namespace

Result<std::vector<std::unique_ptr<Communicator>>> CreateLocalCommunicators(
    const LocalCommunicatorOptions& options) {
  if (options.size < 1) return InvalidArgument("a group needs at least one rank");
  if (!(options.timeout_seconds > 0) || !std::isfinite(options.timeout_seconds)) {
    return InvalidArgument("the collective timeout must be a number of seconds > 0");
  }
  if (options.ranks_per_node < 0) return InvalidArgument("ranks_per_node must be >= 0");
  auto group = std::make_shared<Group>();
  group->size = options.size;
  group->ranks_per_node = options.ranks_per_node == 0 ? options.size : options.ranks_per_node;
  group->timeout_seconds = options.timeout_seconds;
  group->left.assign(size_t(options.size), false);
  std::vector<std::unique_ptr<Communicator>> ranks;
  for (int r = 0; r < options.size; ++r) {
    ranks.push_back(internal::MakeQueuedCommunicator(std::make_unique<LocalWire>(group, r)));
  }
  return ranks;
}

}  // namespace strata::offload
