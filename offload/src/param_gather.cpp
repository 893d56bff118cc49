#include "param_gather.h"

#include <string>

#include "engine_impl.h"

namespace strata::offload {

Status ParamGather::Initialize(size_t slots, size_t slot_bytes) {
  for (size_t i = 0; i < slots; ++i) {
    Slot& slot = slots_.emplace_back();
    STRATA_ASSIGN_OR_RETURN(slot.buffer, AlignedBuffer::Allocate(slot_bytes));
    if (engine_.device_.CanPin()) {
      STRATA_ASSIGN_OR_RETURN(slot.pinned,
                              engine_.device_.PinHostMemory(slot.buffer.data(), slot_bytes));
    }
  }
  return Status();
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
  Engine::Impl& e = engine_;
  const Chunk& c = e.chunks_[chunk];
  slot.chunk = chunk;
  slot.gathered.Reset();
  slot.in_flight = true;
  e.m_.collective_of(CollectiveKind::kAllGather)
      .Increment(double(c.working_bytes(e.working_size())));
  e.environment_.communicator->AllGather(c.host_params.data(), slot.buffer.data(), c.shard.numel(),
                                         e.working_dtype(), /*ready=*/{},
                                         [&slot](Status status) { slot.gathered.Open(status); });
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
    WaitTimer stalled(engine_.m_.stall_of(TrainerWait::kCollective));
    gathered = slot->gathered.Wait();
  }
  slot->in_flight = false;
  if (!gathered.ok()) {
    slot->taken = false;
    slot->chunk.reset();
    return gathered.WithContext("gathering the parameters of chunk " + std::to_string(chunk) +
                                " across ranks");
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
