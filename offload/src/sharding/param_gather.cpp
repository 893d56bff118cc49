#include "sharding/param_gather.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace strata::offload {

ParamGather::ParamGather(Resources resources)
    : options_(resources.options),
      device_(resources.device),
      chunks_(resources.chunks),
      ranks_(resources.ranks),
      metrics_(resources.metrics) {}

bool ParamGather::quantized() const { return options_.placement.quantized_weights; }

bool ParamGather::reads_nvme() const {
  return std::any_of(chunks_.begin(), chunks_.end(), [](const Chunk& c) {
    return c.params_sharded && c.placement.params == Tier::kNvme;
  });
}

size_t ParamGather::SlotExtraBytes(size_t shard_numel) const {
  size_t bytes = 0;
  if (reads_nvme()) bytes += AlignUp(shard_numel * working_size(), kHostAlignment);
  if (quantized()) {
    const size_t one = cpu_adam::QuantizedBytes(shard_numel, kWeightBits);
    bytes += AlignUp(one, kHostAlignment) + AlignUp(one * size_t(ranks_), kHostAlignment);
  }
  return bytes;
}

Status ParamGather::Initialize(size_t slots, size_t slot_bytes, size_t shard_numel) {
  for (size_t i = 0; i < slots; ++i) {
    Slot& slot = slots_.emplace_back();
    if (reads_nvme()) {
      STRATA_ASSIGN_OR_RETURN(slot.nvme_shard,
                              AlignedBuffer::Allocate(shard_numel * working_size()));
    }
    if (quantized()) {
      const size_t one = cpu_adam::QuantizedBytes(shard_numel, kWeightBits);
      STRATA_ASSIGN_OR_RETURN(slot.quantized_shard, AlignedBuffer::Allocate(one));
      STRATA_ASSIGN_OR_RETURN(slot.quantized_shards, AlignedBuffer::Allocate(one * size_t(ranks_)));
    }
    STRATA_ASSIGN_OR_RETURN(slot.buffer, AlignedBuffer::Allocate(slot_bytes));
    if (device_.CanPin()) {
      STRATA_ASSIGN_OR_RETURN(slot.pinned, device_.PinHostMemory(slot.buffer.data(), slot_bytes));
    }
  }
  return Status();
}

void ParamGather::Connect(Communicator& communicator, nvme::SwapSpace* swap,
                          cpu_adam::CpuOptimizer& optimizer) {
  communicator_ = &communicator;
  swap_ = swap;
  optimizer_ = &optimizer;
}

ParamGather::Slot* ParamGather::Find(size_t chunk) {
  for (Slot& slot : slots_) {
    if (slot.chunk == chunk && !slot.taken) return &slot;
  }
  return nullptr;
}

ParamGather::Slot* ParamGather::FreeSlot() {
  for (Slot& slot : slots_) {
    if (!slot.chunk) return &slot;
  }
  return nullptr;
}

void ParamGather::WaitIdle(Slot& slot) {
  // The communicator may still write the slot (and read a shard): a slot is reused, and the
  // shards change, only after its gather is done, whatever its outcome.
  if (slot.in_flight) slot.gathered.Wait().IgnoreError();
  slot.in_flight = false;
}

void ParamGather::Enqueue(Slot& slot, size_t chunk) {
  WaitIdle(slot);
  const Chunk& c = chunks_[chunk];
  slot.chunk = chunk;
  slot.gathered.Reset();
  slot.in_flight = true;
  // Read and quantized on the communicator's thread when the gather's turn comes (see the
  // header). The shard changes only between steps, when no gather runs (Discard); so does the
  // current extent, chosen here on the trainer thread.
  const bool from_nvme = c.placement.params == Tier::kNvme;
  const nvme::ExtentId extent = from_nvme ? c.param_extent() : nvme::ExtentId{};
  const std::byte* shard = from_nvme ? slot.nvme_shard.data() : c.host_params.data();
  const bool quantize = quantized();
  slot.prepare_status = Status();  // A failed communicator may never call `prepare`.
  auto prepare = [this, &c, &slot, from_nvme, extent, shard, quantize] {
    if (from_nvme) {
      slot.prepare_status = swap_->ReadSync(extent, slot.nvme_shard.data());
      if (slot.prepare_status.ok()) {
        metrics_.nvme_read_bytes->Increment(double(c.param_home_bytes(working_size())));
      } else {
        slot.prepare_status = slot.prepare_status.WithContext("reading this rank's shard");
        // What the others gather from this rank then: zeros, not a previous chunk's shard.
        std::memset(slot.nvme_shard.data(), 0, slot.nvme_shard.size());
      }
    }
    if (quantize && slot.prepare_status.ok()) {
      slot.prepare_status = optimizer_
                                ->Quantize(shard, working_dtype(), c.shard.numel(), kWeightBits,
                                           slot.quantized_shard.data())
                                .WithContext("quantizing this rank's shard");
    }
    // A failure must not leave this rank out of a collective the others make: it still takes
    // part, with whatever the buffer holds, and the Take that waits for it fails.
    return Status();
  };
  CollectiveReady ready;
  if (from_nvme || quantize) ready = std::move(prepare);
  auto done = [&slot](Status status) {
    slot.gathered.Open(slot.prepare_status.ok() ? std::move(status) : slot.prepare_status);
  };
  if (!quantize) {
    metrics_.collective_of(CollectiveKind::kAllGather)
        .Increment(double(c.working_bytes(working_size())));
    communicator_->AllGather(shard, slot.buffer.data(), c.shard.numel(), working_dtype(),
                             std::move(ready), std::move(done));
    return;
  }
  const size_t bytes = cpu_adam::QuantizedBytes(c.shard.numel(), kWeightBits);
  metrics_.collective_of(CollectiveKind::kAllGather).Increment(double(bytes * size_t(ranks_)));
  // Moved as 32-bit words: an all-gather copies bits and does no arithmetic on them.
  communicator_->AllGather(slot.quantized_shard.data(), slot.quantized_shards.data(),
                           bytes / sizeof(float), DType::kFp32, std::move(ready), std::move(done));
}

Status ParamGather::Dequantize(Slot& slot, size_t chunk) {
  const Chunk& c = chunks_[chunk];
  const size_t shard = c.shard.numel();
  const size_t bytes = cpu_adam::QuantizedBytes(shard, kWeightBits);
  for (int r = 0; r < ranks_; ++r) {
    STRATA_RETURN_IF_ERROR(optimizer_->Dequantize(
        slot.quantized_shards.data() + size_t(r) * bytes, kWeightBits, shard,
        slot.buffer.data() + size_t(r) * shard * working_size(), working_dtype()));
  }
  return Status();
}

Result<const std::byte*> ParamGather::Take(size_t chunk, std::span<const size_t> upcoming) {
  if (!failed_.ok()) return failed_;
  Slot* slot = Find(chunk);
  if (slot == nullptr) {
    slot = FreeSlot();
    if (slot == nullptr) {
      // Every slot holds a prefetch the trainer has not come to (it left the recorded order):
      // the first one goes. (Every rank decides alike: the trainers call alike.)
      for (Slot& each : slots_) {
        if (!each.taken) {
          slot = &each;
          break;
        }
      }
    }
    Enqueue(*slot, chunk);
  }
  slot->taken = true;
  for (size_t next : upcoming) {
    if (next == chunk || Find(next) != nullptr) continue;
    Slot* free = FreeSlot();
    if (free == nullptr) break;
    Enqueue(*free, next);
  }
  Status gathered;
  {
    WaitTimer stalled(metrics_.stall_of(TrainerWait::kCollective));
    gathered = slot->gathered.Wait();
  }
  slot->in_flight = false;
  // This rank's own part failed (reading, quantizing or dequantizing its shard), not the
  // collective, which the other ranks went on from.
  bool own_part_failed = !slot->prepare_status.ok();
  if (gathered.ok() && quantized()) {
    gathered = Dequantize(*slot, chunk);
    own_part_failed = !gathered.ok();
  }
  if (!gathered.ok()) {
    slot->taken = false;
    slot->chunk.reset();
    Status error = gathered.WithContext("gathering the parameters of chunk " +
                                        std::to_string(chunk) + " across ranks");
    // A retry would gather once more than the other ranks do.
    if (own_part_failed) Fail(error);
    return error;
  }
  return static_cast<const std::byte*>(slot->buffer.data());
}

void ParamGather::Return(size_t chunk) {
  for (Slot& slot : slots_) {
    if (slot.chunk == chunk && slot.taken) {
      slot.taken = false;
      slot.chunk.reset();
      return;
    }
  }
}

void ParamGather::Fail(const Status& error) {
  if (!failed_.ok()) return;
  failed_ = FailedPrecondition(
      "an Acquire failed on this rank after the ranks gathered its chunk's parameters (" +
      error.ToString() +
      "); with zero_optimization.stage 3 every rank's Acquire is a collective, so this rank "
      "cannot go on in step with the others: restart the ranks");
}

void ParamGather::Discard() {
  for (Slot& slot : slots_) {
    WaitIdle(slot);
    if (!slot.taken) slot.chunk.reset();
  }
}

}  // namespace strata::offload
