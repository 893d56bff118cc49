#include "strata/nvme/fault_injection.h"

#include <algorithm>
#include <thread>
#include <unordered_map>

namespace strata::nvme {

void FaultPlan::Add(FaultRule rule) {
  std::lock_guard lock(mutex_);
  rules_.push_back({rule});
}

void FaultPlan::Clear() {
  std::lock_guard lock(mutex_);
  rules_.clear();
}

int FaultPlan::fired() const {
  std::lock_guard lock(mutex_);
  return fired_;
}

std::optional<FaultRule> FaultPlan::Match(const IoPiece& piece) {
  std::lock_guard lock(mutex_);
  for (Armed& armed : rules_) {
    const FaultRule& rule = armed.rule;
    if (rule.op && *rule.op != piece.op) continue;
    if (piece.offset + piece.length <= rule.offset_begin || piece.offset >= rule.offset_end) {
      continue;
    }
    if (armed.seen++ < rule.skip) continue;
    if (rule.times >= 0 && armed.fired >= rule.times) continue;
    ++armed.fired;
    ++fired_;
    return rule;
  }
  return std::nullopt;
}

namespace {

using Clock = std::chrono::steady_clock;

class FaultInjectingBackend final : public IoBackend {
 public:
  FaultInjectingBackend(std::unique_ptr<IoBackend> inner, std::shared_ptr<FaultPlan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)) {}

  ~FaultInjectingBackend() override {
    for (auto& timer : timers_) timer.join();
  }

  std::string name() const override { return "faulty(" + inner_->name() + ")"; }
  Status Start(uint32_t queue_depth) override { return inner_->Start(queue_depth); }
  Result<bool> RegisterBuffers(std::span<const iovec> buffers) override {
    return inner_->RegisterBuffers(buffers);
  }
  int RegisterFile(int fd) override { return inner_->RegisterFile(fd); }
  void UnregisterFile(int fixed_index) override { inner_->UnregisterFile(fixed_index); }

  void Issue(IoPiece* piece) override {
    std::optional<FaultRule> rule = plan_->Match(*piece);
    if (!rule) {
      inner_->Issue(piece);
      return;
    }
    switch (rule->kind) {
      case FaultKind::kError:
        injected_.emplace_back(piece, -static_cast<int64_t>(rule->error));
        break;
      case FaultKind::kShortTransfer:
        if (rule->short_bytes < piece->length) {
          altered_[piece] = {Alteration::kShort, piece->length};
          piece->length = rule->short_bytes;
        }
        inner_->Issue(piece);
        break;
      case FaultKind::kDelay: {
        delayed_.push_back({piece, Clock::now() + rule->delay});
        // Wake the engine when the delay is over, so the piece is issued then.
        IoBackend* inner = inner_.get();
        timers_.emplace_back([inner, delay = rule->delay] {
          std::this_thread::sleep_for(delay);
          inner->Wake();
        });
        break;
      }
      case FaultKind::kCorruptRead:
        altered_[piece] = {Alteration::kCorrupt, piece->length};
        inner_->Issue(piece);
        break;
    }
  }

  Status SubmitAndWait(const PieceCompletion& complete) override {
    IssueDueDelayed();
    if (!injected_.empty()) {
      // Completions are ready without the kernel; do not block waiting for others.
      auto ready = std::move(injected_);
      injected_.clear();
      for (auto& [piece, result] : ready) complete(piece, result);
      return Status();
    }
    return inner_->SubmitAndWait([&](IoPiece* piece, int64_t result) {
      auto it = altered_.find(piece);
      if (it != altered_.end()) {
        const Alteration alteration = it->second;
        altered_.erase(it);
        if (alteration.kind == Alteration::kShort) {
          piece->length = alteration.original_length;  // The engine sees a short transfer.
        } else if (result > 0) {
          piece->buffer[static_cast<size_t>(result) / 2] ^= std::byte{0x10};
        }
      }
      complete(piece, result);
    });
  }

  void Wake() override { inner_->Wake(); }

 private:
  struct Alteration {
    enum Kind { kShort, kCorrupt } kind;
    size_t original_length;
  };
  struct Delayed {
    IoPiece* piece;
    Clock::time_point due;
  };

  void IssueDueDelayed() {
    const auto now = Clock::now();
    for (auto it = delayed_.begin(); it != delayed_.end();) {
      if (it->due <= now) {
        inner_->Issue(it->piece);
        it = delayed_.erase(it);
      } else {
        ++it;
      }
    }
  }

  const std::unique_ptr<IoBackend> inner_;
  const std::shared_ptr<FaultPlan> plan_;
  std::vector<std::pair<IoPiece*, int64_t>> injected_;
  std::unordered_map<IoPiece*, Alteration> altered_;
  std::vector<Delayed> delayed_;
  std::vector<std::thread> timers_;
};

}  // namespace

std::unique_ptr<IoBackend> CreateFaultInjectingBackend(std::unique_ptr<IoBackend> inner,
                                                       std::shared_ptr<FaultPlan> plan) {
  return std::make_unique<FaultInjectingBackend>(std::move(inner), std::move(plan));
}

}  // namespace strata::nvme
