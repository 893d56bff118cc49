#include "residency/residency.h"

#include <algorithm>
#include <limits>

#include "strata/core/bytes.h"
#include "strata/core/log.h"
#include "strata/nvme/async_io.h"

namespace strata::offload {

Status RecordTrainerEvent(Device& device, DeviceEvent& event, TrainerStream stream) {
  if (stream.native == nullptr) return device.RecordEvent(event, Stream::kCompute);
  return device.RecordEventOnNativeStream(event, stream.native);
}

Residency::Residency(Resources resources)
    : options_(resources.options),
      device_(resources.device),
      device_budget_(resources.device_budget),
      chunks_(resources.chunks),
      metrics_(resources.metrics),
      spawn_(std::move(resources.spawn)) {}

Status Residency::Initialize(LoopStagingPool* param_staging, nvme::SwapSpace* swap,
                             const AlignedBuffer& zeros) {
  param_staging_ = param_staging;
  swap_ = swap;
  zeros_ = &zeros;
  copies_.resize(chunks_.size());
  for (size_t i = 0; i < copies_.size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(copies_[i].released, device_.CreateEvent());
    if (!chunks_[i].params_offloaded()) copies_[i].state = State::kResident;
  }
  return Status();
}

ChunkView Residency::ViewLocked(size_t chunk) const {
  const Chunk& c = chunks_[chunk];
  const Copy& copy = copies_[chunk];
  if (!c.params_offloaded()) {
    return {c.params.data(), c.grads.data(), c.numel, working_dtype()};
  }
  return {copy.memory.params.data(), copy.memory.grads.data(), c.numel, working_dtype()};
}

bool Residency::Held(size_t chunk) const {
  std::lock_guard lock(mutex_);
  return copies_[chunk].pins > 0;
}

std::vector<size_t> Residency::Upcoming(size_t chunk, size_t count) const {
  std::lock_guard lock(mutex_);
  std::vector<size_t> upcoming;
  if (recording_) return upcoming;
  // Where RecordAccessLocked will find this access.
  size_t i = order_position_;
  while (i < order_.size() && order_[i] != chunk) ++i;
  for (++i; i < order_.size() && upcoming.size() < count; ++i) {
    const size_t next = order_[i];
    if (chunks_[next].params_sharded && copies_[next].pins == 0) upcoming.push_back(next);
  }
  return upcoming;
}

Result<ChunkView> Residency::Acquire(size_t chunk, const std::byte* gathered) {
  std::unique_lock lock(mutex_);
  Copy& copy = copies_[chunk];
  const Chunk& c = chunks_[chunk];
  // Fetches of this acquisition copy the gathered parameters; it outlives them (this call waits
  // for each).
  copy.gathered = gathered;
  struct ForgetGathered {
    Copy& copy;
    ~ForgetGathered() { copy.gathered = nullptr; }
  } forget{copy};
  ++copy.pins;
  copy.last_use = ++use_tick_;
  copy.grads_declared = false;
  if (c.params_offloaded()) RecordAccessLocked(chunk);
  for (bool prefetched = false;;) {
    if (copy.state == State::kAbsent) {
      Status started = StartFetchLocked(chunk, /*demand=*/true, lock);
      if (!started.ok()) {
        --copy.pins;
        return started;
      }
    }
    if (c.params_offloaded() && !prefetched) {
      PrefetchLocked(lock);
      prefetched = true;
    }
    auto ready = [&] { return copy.state != State::kFetching && copy.grad_pins == 0; };
    if (!ready()) {
      // The trainer stalls here: on the fetch if one is running, else on the gradient copy.
      const TrainerWait reason = copy.state != State::kFetching ? TrainerWait::kDeviceToHost
                                 : c.fetched_from_nvme()        ? TrainerWait::kNvme
                                                                : TrainerWait::kHostToDevice;
      WaitTimer stalled(metrics_.stall_of(reason));
      changed_.wait(lock, ready);
    }
    if (copy.state == State::kResident) return ViewLocked(chunk);
    if (!copy.fetch_status.ok()) {
      --copy.pins;
      Status failed = std::exchange(copy.fetch_status, Status());
      return failed.WithContext("fetching the parameters of chunk " + std::to_string(chunk));
    }
    // A fetch from before the last commit landed stale and was dropped: fetch it again.
  }
}

void Residency::Release(size_t chunk, TrainerStream stream) {
  std::lock_guard lock(mutex_);
  Copy& copy = copies_[chunk];
  if (copy.pins == 0) return;
  --copy.pins;
  // The trainer's device work on this chunk is queued on its stream: eviction and the commit
  // wait for it, so remember where it ends. If the device cannot mark it there, wait for it
  // here: slow, but nothing is freed or overwritten under the trainer's feet.
  if (Status recorded = RecordTrainerEvent(device_, copy.released, stream); !recorded.ok()) {
    Log(LogLevel::kWarning, "Release(" + std::to_string(chunk) +
                                "): cannot record the end of the trainer's work (" +
                                recorded.ToString() + "); waiting for the device instead");
    device_.Synchronize().IgnoreError();
  }
  changed_.notify_all();
}

Result<ChunkView> Residency::PinGrads(size_t chunk) {
  std::lock_guard lock(mutex_);
  Copy& copy = copies_[chunk];
  if (copy.pins == 0) {
    return FailedPrecondition("GradsReady(" + std::to_string(chunk) +
                              ") on a chunk that is not acquired; call it before Release");
  }
  if (copy.grads_declared) {
    // The previous micro-step's gradients may still be copying out of the buffer that the
    // next backward writes: only Acquire waits for that.
    return FailedPrecondition("GradsReady(" + std::to_string(chunk) +
                              ") twice under one Acquire; acquire the chunk again before each "
                              "micro-step's backward");
  }
  copy.grads_declared = true;
  ++copy.grad_pins;
  return ViewLocked(chunk);
}

void Residency::UnpinGrads(size_t chunk) {
  std::lock_guard lock(mutex_);
  --copies_[chunk].grad_pins;
  changed_.notify_all();
}

std::optional<size_t> Residency::FirstAcquired() const {
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < copies_.size(); ++i) {
    if (copies_[i].pins > 0) return i;
  }
  return std::nullopt;
}

Status Residency::OrderAfterTrainerUse(Stream stream) {
  std::lock_guard lock(mutex_);
  for (const Copy& copy : copies_) {
    if (copy.state == State::kResident) {
      STRATA_RETURN_IF_ERROR(device_.StreamWaitEvent(stream, copy.released));
    }
  }
  return Status();
}

Result<bool> Residency::OrderAfterTrainerUse(size_t chunk, Stream stream) {
  std::lock_guard lock(mutex_);
  const Copy& copy = copies_[chunk];
  if (copy.pins > 0) return false;  // Its release event is not recorded yet.
  STRATA_RETURN_IF_ERROR(device_.StreamWaitEvent(stream, copy.released));
  return true;
}

Status Residency::WaitForTrainerUse() {
  // Only the trainer thread records release events, and it is the caller: they stay put.
  for (size_t i = 0; i < copies_.size(); ++i) {
    STRATA_RETURN_IF_ERROR(device_.SynchronizeEvent(copies_[i].released));
  }
  return Status();
}

void Residency::DropLocked(Copy& copy) {
  copy.state = State::kAbsent;
  spare_.push_back(std::exchange(copy.memory, Memory()));
}

std::optional<Residency::Memory> Residency::TakeSpareLocked(uint64_t slot_bytes, size_t param_bytes,
                                                            bool grads) {
  for (auto it = spare_.begin(); it != spare_.end(); ++it) {
    if (it->slot.bytes() == slot_bytes && it->params.size() == param_bytes &&
        it->grads.valid() == grads) {
      Memory memory = std::move(*it);
      spare_.erase(it);
      return memory;
    }
  }
  return std::nullopt;
}

void Residency::FreeSpareLocked(std::unique_lock<std::mutex>& lock) {
  Memory freed = std::move(spare_.back());
  spare_.pop_back();
  // Freeing device memory may wait for the device (cudaFree does): not under the lock.
  lock.unlock();
  freed = Memory();
  lock.lock();
}

void Residency::Drop(const std::vector<size_t>& chunks) {
  std::lock_guard lock(mutex_);
  for (size_t i : chunks) {
    if (!chunks_[i].params_offloaded()) continue;
    Copy& copy = copies_[i];
    if (copy.state == State::kFetching) copy.stale = true;
    if (copy.state == State::kResident) DropLocked(copy);
  }
  changed_.notify_all();
}

void Residency::StepCommitted() {
  std::lock_guard lock(mutex_);
  recording_ = false;
  order_position_ = 0;
}

void Residency::RecordAccessLocked(size_t chunk) {
  if (recording_) {
    order_.push_back(chunk);
    return;
  }
  // Follow the recorded order; an access out of order resynchronizes at its next occurrence.
  for (size_t i = order_position_; i < order_.size(); ++i) {
    if (order_[i] == chunk) {
      order_position_ = i + 1;
      return;
    }
  }
}

size_t Residency::NextUseLocked(size_t chunk) const {
  for (size_t i = order_position_; i < order_.size(); ++i) {
    if (order_[i] == chunk) return i - order_position_;
  }
  return std::numeric_limits<size_t>::max();
}

std::optional<size_t> Residency::PickVictimLocked(size_t target, bool demand) const {
  const bool known_order = !recording_;
  const size_t target_use = known_order ? NextUseLocked(target) : 0;
  std::optional<size_t> victim;
  size_t victim_use = 0;
  uint64_t victim_tick = std::numeric_limits<uint64_t>::max();
  for (size_t i = 0; i < copies_.size(); ++i) {
    const Copy& copy = copies_[i];
    if (i == target || !chunks_[i].params_offloaded() || copy.state != State::kResident ||
        copy.pins > 0 || copy.grad_pins > 0) {
      continue;
    }
    if (known_order) {
      const size_t use = NextUseLocked(i);
      // A prefetch never evicts a chunk needed before the one it fetches.
      if (!demand && use <= target_use) continue;
      if (!victim || use > victim_use) {
        victim = i;
        victim_use = use;
      }
    } else if (copy.last_use < victim_tick) {
      victim = i;
      victim_tick = copy.last_use;
    }
  }
  return victim;
}

void Residency::EvictLocked(size_t chunk, std::unique_lock<std::mutex>& lock) {
  Copy& copy = copies_[chunk];
  copy.state = State::kEvicting;
  Memory memory = std::exchange(copy.memory, Memory());
  // The trainer's queued work on the chunk must finish before its memory is reused. Wait, and
  // without the lock: that work may call into the engine. Nothing else moves an evicting chunk.
  // Its memory is then spare, for the fetch that evicted it.
  lock.unlock();
  device_.SynchronizeEvent(copy.released).IgnoreError();
  lock.lock();
  spare_.push_back(std::move(memory));
  copy.state = State::kAbsent;
  metrics_.evictions->Increment();
}

Status Residency::StartFetchLocked(size_t chunk, bool demand, std::unique_lock<std::mutex>& lock) {
  const Chunk& c = chunks_[chunk];
  Copy& copy = copies_[chunk];
  TierBudget& budget = device_budget_;  // Only Residency writes it after the placement.
  const uint64_t bytes = c.device_slot_bytes(working_dtype());
  const size_t wbytes = c.working_bytes(working_size());
  std::optional<Memory> memory;
  // Memory of the chunk's size that an eviction or a commit left spare, else new memory within
  // the budget: spare memory of other sizes goes first, then victims, whose memory may fit.
  while (!(memory = TakeSpareLocked(bytes, wbytes, !c.frozen())) && !budget.TryReserve(bytes)) {
    if (!spare_.empty()) {
      FreeSpareLocked(lock);
      continue;
    }
    if (std::optional<size_t> victim = PickVictimLocked(chunk, demand)) {
      EvictLocked(*victim, lock);
      continue;
    }
    if (!demand) return Unavailable("no room to prefetch");
    // Memory comes back only when a fetch or a gradient copy in flight finishes.
    const bool can_free = std::any_of(copies_.begin(), copies_.end(), [](const Copy& other) {
      return other.state == State::kFetching ||
             (other.grad_pins > 0 && other.memory.params.valid());
    });
    if (!can_free) {
      std::string pinned;
      for (size_t i = 0; i < copies_.size(); ++i) {
        if (copies_[i].pins > 0 && i != chunk) pinned += " " + std::to_string(i);
      }
      return ResourceExhausted("device memory budget of " +
                               FormatBytes(budget.usage().budget_bytes) + " cannot hold chunk " +
                               std::to_string(chunk) + " (" + FormatBytes(bytes) + "; " +
                               FormatBytes(budget.free_bytes()) + " free) while chunks" +
                               (pinned.empty() ? std::string(" (none)") : pinned) +
                               " are acquired; release chunks earlier or raise the device budget");
    }
    WaitTimer stalled(metrics_.stall_of(TrainerWait::kDeviceMemory));
    changed_.wait(lock);
  }
  if (!memory) {
    BudgetReservation slot(&budget, bytes);
    STRATA_ASSIGN_OR_RETURN(DeviceBuffer params, device_.Allocate(wbytes));
    DeviceBuffer grads;  // A frozen chunk has none.
    if (!c.frozen()) {
      STRATA_ASSIGN_OR_RETURN(grads, device_.Allocate(wbytes));
    }
    memory =
        Memory{.slot = std::move(slot), .params = std::move(params), .grads = std::move(grads)};
  }
  copy.memory = std::move(*memory);
  copy.state = State::kFetching;
  copy.stale = false;
  copy.fetch_status = Status();
  spawn_(Fetch(chunk));
  return Status();
}

void Residency::PrefetchLocked(std::unique_lock<std::mutex>& lock) {
  const int depth = options_.placement.prefetch_depth;
  if (recording_ || depth <= 0) return;
  int issued = 0;
  for (size_t i = order_position_; i < order_.size() && issued < depth; ++i) {
    // A stage-3 chunk comes only with the parameters its Acquire gathers.
    if (chunks_[order_[i]].params_sharded) continue;
    if (copies_[order_[i]].state == State::kAbsent &&
        !StartFetchLocked(order_[i], /*demand=*/false, lock).ok()) {
      return;  // No room: stop here.
    }
    ++issued;  // Fetched now, or already there or on its way: it counts toward the depth.
  }
}

Awaitable<void> Residency::Fetch(size_t chunk) {
  const Chunk& c = chunks_[chunk];
  Copy& copy = copies_[chunk];  // Its buffers stay put while it is fetching.
  const size_t bytes = c.working_bytes(working_size());
  Status status;
  const std::byte* source = c.params_sharded ? copy.gathered : c.host_params.data();
  if (source == nullptr) {  // Only Acquire fetches a stage-3 chunk, with what it gathered.
    status = Internal("chunk " + std::to_string(chunk) +
                      " was fetched without its gathered "
                      "parameters");
  }
  StagingBuffer staging;  // NVMe-home parameters come up through one (stage 3: the gather's).
  if (c.fetched_from_nvme()) {
    staging = co_await param_staging_->Acquire();
    {
      InFlightGuard reading(metrics_.in_flight_of(InFlightKind::kNvmeRead));
      status = co_await nvme::AwaitSwapRead(*swap_, c.param_extent(), staging.data());
    }
    if (status.ok()) metrics_.nvme_read_bytes->Increment(double(bytes));
    source = staging.data();
  }
  if (status.ok()) {
    // The parameters, then a gradient buffer starting at zero (padding included): one wait for
    // both on the in-order stream, before the staging buffer goes back.
    InFlightGuard uploading(metrics_.in_flight_of(InFlightKind::kHostToDevice));
    status = device_.CopyToDevice(copy.memory.params.data(), source, bytes);
    if (status.ok() && !c.frozen()) {
      status = device_.CopyToDevice(copy.memory.grads.data(), zeros_->data(), bytes);
    }
    const Status landed = co_await AwaitStream(device_, Stream::kHostToDevice);
    if (status.ok()) status = landed;
  }
  if (param_staging_) param_staging_->Release(staging);
  if (status.ok()) {
    metrics_.h2d_bytes->Increment(double(c.frozen() ? bytes : 2 * bytes));
    metrics_.fetches->Increment();
    metrics_.fetched_bytes[c.fetched_from_nvme()]->Increment(double(bytes));
  }
  std::lock_guard lock(mutex_);
  if (status.ok() && !copy.stale) {
    copy.state = State::kResident;
  } else {
    copy.fetch_status = status;
    DropLocked(copy);
  }
  changed_.notify_all();
}

}  // namespace strata::offload
