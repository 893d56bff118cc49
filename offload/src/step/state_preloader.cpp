// The read-ahead of NVMe-kept optimizer states: its policy, its reads and its slots. See
// state_preloader.h.
#include "step/state_preloader.h"

#include "step/chunk_step.h"
#include "strata/nvme/async_io.h"

namespace strata::offload {

void StatePreloader::Open(std::unique_ptr<StagingPool> pool, nvme::IoEngine& io,
                          nvme::SwapSpace& swap) {
  registered_ = io.RegisterBuffers(pool->arena(), pool->buffer_bytes());
  pool_.emplace(std::move(pool));
  swap_ = &swap;
  slots_.resize(chunks_.size());
}

void StatePreloader::Start(bool participants_known) {
  if (!pool_) return;
  // Counting the reads ahead still held (by chunks that sat the last step out).
  const size_t depth = ReadAheadDepth(pool_->pool().buffer_count());
  size_t held = 0;
  for (const Slot& slot : slots_) held += slot.active ? 1 : 0;
  // In the order backward produces gradients (the last chunk first), the chunks whose update
  // still has to read its states: reading ahead of backward, so that the last chunks' reads
  // are not left to the end of the step.
  for (size_t i = slots_.size(); i-- > 0 && held < depth;) {
    const Chunk& c = chunks_[i];
    if (c.placement.optimizer_states != Tier::kNvme || slots_[i].active) continue;
    const ChunkPhase phase = steps_[i].phase_now();
    if (phase == ChunkPhase::kUpdating || phase == ChunkPhase::kUpdated) continue;  // Read.
    if (participants_known && steps_[i].micro_steps == 0) continue;  // Sits this step out.
    StartRead(i);
    ++held;
  }
}

void StatePreloader::StartRead(size_t chunk) {
  Slot& slot = slots_[chunk];
  slot.active = true;
  slot.ready.emplace(0);
  spawn_(Read(chunk));
}

Awaitable<void> StatePreloader::Read(size_t chunk) {
  const Chunk& c = chunks_[chunk];
  Slot& slot = slots_[chunk];
  StagingBuffer buffer = co_await pool_->Acquire();
  Status status;
  {
    InFlightGuard reading(metrics_.in_flight_of(InFlightKind::kNvmeRead));
    status = co_await nvme::AwaitSwapRead(*swap_, c.state_extent(), buffer.data(),
                                          FixedBufferIndex(buffer));
  }
  if (status.ok()) {
    metrics_.nvme_read_bytes->Increment(double(c.state_bytes()));
    slot.buffer = std::move(buffer);
  } else {
    pool_->Release(buffer);
  }
  slot.status = status;
  slot.done = true;
  slot.ready->Release();
}

Awaitable<Result<StagingBuffer>> StatePreloader::Take(size_t chunk) {
  Slot& slot = slots_[chunk];
  if (!slot.active) StartRead(chunk);
  co_await slot.ready->Acquire();
  Result<StagingBuffer> taken = slot.status.ok() ? Result<StagingBuffer>(std::move(slot.buffer))
                                                 : Result<StagingBuffer>(slot.status);
  slot = {};
  co_return taken;
}

void StatePreloader::Return(StagingBuffer& buffer) {
  if (pool_) pool_->Release(buffer);
}

Awaitable<void> StatePreloader::Drop(size_t chunk) {
  if (!pool_) co_return;
  Slot& slot = slots_[chunk];
  if (!slot.active) co_return;
  co_await slot.ready->Acquire();
  pool_->Release(slot.buffer);
  slot = {};
}

Awaitable<void> StatePreloader::DropAll() {
  // Finished reads first: their buffers may be what the reads still in flight wait for.
  for (Slot& slot : slots_) {
    if (!slot.active || !slot.done) continue;
    pool_->Release(slot.buffer);
    slot = {};
  }
  for (size_t i = 0; i < slots_.size(); ++i) co_await Drop(i);
}

}  // namespace strata::offload
