// Parameter residency during forward and backward (ZeRO-3 style offload): fetching offloaded
// chunks to the device, prefetching the ones expected next, and evicting under the device
// budget. The order of Acquire calls in the first step is recorded; afterwards it predicts the
// next chunks (prefetch) and each chunk's next use (eviction drops the chunk used furthest in
// the future, Belady's rule). Before the order is known, eviction is least recently used.
#include <algorithm>
#include <optional>

#include "engine_impl.h"
#include "strata/core/bytes.h"

namespace strata::offload {

Result<ChunkView> Engine::Impl::Acquire(size_t chunk) {
  if (chunk >= chunks_.size()) {
    return InvalidArgument("chunk " + std::to_string(chunk) + " does not exist (the engine has " +
                           std::to_string(chunks_.size()) + ")");
  }
  std::unique_lock lock(mutex_);
  Chunk& c = chunks_[chunk];
  if (step_running_) {
    return FailedPrecondition("Acquire(" + std::to_string(chunk) +
                              ") while a step is running; wait for Step() to complete");
  }
  ++c.pins;
  c.last_use = ++use_tick_;
  if (c.params_offloaded()) {
    RecordAccess(chunk);
    if (!c.resident && !c.fetching) {
      Status started = StartFetch(chunk, /*demand=*/true, lock);
      if (!started.ok()) {
        --c.pins;
        return started;
      }
    }
    Prefetch(lock);
  }
  auto ready = [&] { return (!c.params_offloaded() || !c.fetching) && !c.grads_in_flight; };
  if (!ready()) {
    // The trainer stalls here: on the fetch if one is running, else on the gradient copy.
    const TrainerWait reason = !c.fetching                         ? TrainerWait::kDeviceToHost
                               : c.placement.params == Tier::kNvme ? TrainerWait::kNvme
                                                                   : TrainerWait::kHostToDevice;
    WaitTimer stalled(m_.stall_of(reason));
    cv_.wait(lock, ready);
  }
  if (c.params_offloaded() && !c.resident) {
    --c.pins;
    Status failed = c.fetch_status;
    c.fetch_status = Status();
    return failed.WithContext("fetching the parameters of chunk " + std::to_string(chunk));
  }
  return ChunkView{c.params.data(), c.grads.data(), c.numel, working_dtype()};
}

void Engine::Impl::Release(size_t chunk) {
  if (chunk >= chunks_.size()) return;
  std::lock_guard lock(mutex_);
  Chunk& c = chunks_[chunk];
  if (c.pins == 0) return;
  --c.pins;
  // The trainer's device work on this chunk is queued on the compute stream: eviction must wait
  // for it, so remember where it ends.
  device_.RecordEvent(c.released, Stream::kCompute).IgnoreError();
  cv_.notify_all();
}

void Engine::Impl::RecordAccess(size_t chunk) {
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

size_t Engine::Impl::NextUse(size_t chunk) const {
  for (size_t i = order_position_; i < order_.size(); ++i) {
    if (order_[i] == chunk) return i - order_position_;
  }
  return std::numeric_limits<size_t>::max();
}

std::optional<size_t> Engine::Impl::PickVictim(size_t target, bool demand) const {
  const bool known_order = !recording_;
  const size_t target_use = known_order ? NextUse(target) : 0;
  std::optional<size_t> victim;
  size_t victim_use = 0;
  uint64_t victim_tick = std::numeric_limits<uint64_t>::max();
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    if (i == target || !c.params_offloaded() || !c.resident || c.pins > 0 || c.fetching ||
        c.grads_in_flight) {
      continue;
    }
    if (known_order) {
      const size_t use = NextUse(i);
      // A prefetch never evicts a chunk needed before the one it fetches.
      if (!demand && use <= target_use) continue;
      if (!victim || use > victim_use) {
        victim = i;
        victim_use = use;
      }
    } else if (c.last_use < victim_tick) {
      victim = i;
      victim_tick = c.last_use;
    }
  }
  return victim;
}

void Engine::Impl::Evict(size_t chunk) {
  Chunk& c = chunks_[chunk];
  // The trainer's queued work on the chunk must finish before its memory is reused.
  device_.SynchronizeEvent(c.released).IgnoreError();
  c.DropDeviceCopy();
  m_.evictions->Increment();
}

Status Engine::Impl::StartFetch(size_t chunk, bool demand, std::unique_lock<std::mutex>& lock) {
  Chunk& c = chunks_[chunk];
  const uint64_t bytes = c.device_slot_bytes(working_dtype());
  while (!device_budget_.TryReserve(bytes)) {
    if (std::optional<size_t> victim = PickVictim(chunk, demand)) {
      Evict(*victim);
      continue;
    }
    if (!demand) return Unavailable("no room to prefetch");
    // Memory comes back only when a fetch or a gradient copy in flight finishes.
    const bool can_free = std::any_of(chunks_.begin(), chunks_.end(), [](const Chunk& other) {
      return other.params_offloaded() && (other.fetching || other.grads_in_flight);
    });
    if (!can_free) {
      std::string pinned;
      for (size_t i = 0; i < chunks_.size(); ++i) {
        if (chunks_[i].pins > 0 && i != chunk) pinned += " " + std::to_string(i);
      }
      return ResourceExhausted(
          "device memory budget of " + FormatBytes(device_budget_.usage().budget_bytes) +
          " cannot hold chunk " + std::to_string(chunk) + " (" + FormatBytes(bytes) + "; " +
          FormatBytes(device_budget_.free_bytes()) + " free) while chunks" +
          (pinned.empty() ? std::string(" (none)") : pinned) +
          " are acquired; release chunks earlier or raise the device budget");
    }
    WaitTimer stalled(m_.stall_of(TrainerWait::kDeviceMemory));
    cv_.wait(lock);
  }
  BudgetReservation slot(&device_budget_, bytes);
  Result<DeviceBuffer> params = device_.Allocate(c.working_bytes(working_size()));
  if (!params.ok()) return params.status();
  Result<DeviceBuffer> grads = device_.Allocate(c.working_bytes(working_size()));
  if (!grads.ok()) return grads.status();
  c.params = std::move(params).value();
  c.grads = std::move(grads).value();
  c.device_slot = std::move(slot);
  c.fetching = true;
  c.stale_fetch = false;
  c.fetch_status = Status();
  boost::asio::co_spawn(loop_.executor(), FetchChunk(chunk), boost::asio::detached);
  return Status();
}

void Engine::Impl::Prefetch(std::unique_lock<std::mutex>& lock) {
  if (recording_ || options_.placement.prefetch_depth <= 0) return;
  int issued = 0;
  for (size_t i = order_position_; i < order_.size() && issued < options_.placement.prefetch_depth;
       ++i) {
    Chunk& c = chunks_[order_[i]];
    if (c.resident || c.fetching) {
      ++issued;  // Already on its way: it counts toward the depth.
      continue;
    }
    if (!StartFetch(order_[i], /*demand=*/false, lock).ok()) return;  // No room: stop here.
    ++issued;
  }
}

Awaitable<void> Engine::Impl::FetchChunk(size_t chunk) {
  Chunk& c = chunks_[chunk];
  const size_t bytes = c.working_bytes(working_size());
  Status status;
  const std::byte* source = c.host_params.data();
  StagingBuffer staging;  // NVMe-home parameters come up through one.
  if (c.placement.params == Tier::kNvme) {
    staging = co_await param_staging_->Acquire();
    {
      InFlightGuard reading(m_.in_flight_of(InFlightKind::kNvmeRead));
      status =
          co_await nvme::AwaitSwapRead(*swap_, c.param_extents[c.param_current], staging.data());
    }
    if (status.ok()) m_.nvme_read_bytes->Increment(double(bytes));
    source = staging.data();
  }
  if (status.ok()) {
    // The parameters, then a gradient buffer starting at zero (padding included): one wait for
    // both on the in-order stream, before the staging buffer goes back.
    InFlightGuard uploading(m_.in_flight_of(InFlightKind::kHostToDevice));
    status = device_.CopyToDevice(c.params.data(), source, bytes);
    if (status.ok()) {
      const Status zeroed = device_.CopyToDevice(c.grads.data(), zeros_.data(), bytes);
      const Status landed = co_await AwaitStream(device_, Stream::kHostToDevice);
      status = zeroed.ok() ? landed : zeroed;
    }
  }
  if (param_staging_) param_staging_->Release(staging);
  if (status.ok()) {
    m_.h2d_bytes->Increment(double(bytes));
    m_.fetches->Increment();
  }
  std::lock_guard lock(mutex_);
  c.fetching = false;
  if (status.ok() && !c.stale_fetch) {
    c.resident = true;
  } else {
    c.fetch_status = status.ok() ? Status() : status;
    c.DropDeviceCopy();
  }
  cv_.notify_all();
}

void Engine::Impl::DropOffloadedCopies() {
  for (size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = chunks_[i];
    if (!c.params_offloaded()) continue;
    if (c.fetching) c.stale_fetch = true;
    if (c.resident) c.DropDeviceCopy();
  }
}

}  // namespace strata::offload
