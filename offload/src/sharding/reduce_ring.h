// ReduceRing: the fp32 buffers a sharded step reduce-scatters gradients from, when the landed
// gradients go to a reduce-scatter as they are: each step reduces each chunk once
// (gradient_accumulation_steps 1), or every micro-step is reduced into the shard (ZeRO stages 2
// and 3 with accumulation). A chunk's fp32 gradients live only from their widening to the end
// of their reduce-scatter, so a few buffers, taken in the order the reduce-scatters are
// enqueued, replace one as large as every chunk: host memory for the gradients falls from the
// working gradients plus the fp32 sum of every chunk (6 bytes a parameter with bf16) to the
// working gradients, this rank's fp32 shard and the few buffers. The price: a chunk's widening
// waits for the reduce-scatter two before it, not for backward alone (widening is far quicker
// than the link).
//
// Reducing every micro-step, a slot also holds the reduce-scatter's output (this rank's shard of
// one micro-step's sum over ranks), which the journey adds into the chunk's shard; that journey
// is then the slot's reader, as with quantized gradients below.
//
// Reduce-scatter number p reads slot p mod N. It is the slot's to write once number p - N is
// done with it twice over: its collective completed (it read the slot) and its writer finished
// (it wrote the slot). Turns go strictly by number, never by which writer comes first: the
// communicator runs the collectives in number order, and a later number holding the slot that
// an earlier one waits for would wait on that earlier one forever.
//
// With ZeRO++'s quantized gradients each slot also holds what the all-to-all sends (this
// rank's gradients quantized, partition by partition) and receives; its reader is then the
// journey that sums what was received, not the collective, and it releases the slot's second
// end once it has.
//
// Threads: Next on the trainer thread (under the step pipeline's mutex, where reduce-scatters
// are enqueued); WaitTurn, MarkFilled and Release on the loop thread; WaitFilled on the
// communicator's.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "strata/core/aligned_buffer.h"
#include "strata/core/event_loop.h"
#include "strata/core/status.h"

namespace strata::offload {

class ReduceRing {
 public:
  /// `slots` buffers of `slot_numel` floats (the largest trained chunk), for quantized
  /// gradients two of `quantized_bytes` each, and for reduce-scatters whose output the journey
  /// reads one of `output_numel` floats (the largest shard; 0: none). The caller has reserved
  /// them on the host budget.
  Status Initialize(size_t slots, size_t slot_numel, size_t quantized_bytes, size_t output_numel);

  /// The next reduce-scatter's number: its place in enqueue order (trainer thread).
  uint64_t Next() { return next_number_++; }
  /// The slot reduce-scatter `number` reads, once its writer has filled it.
  float* Input(uint64_t number) { return reinterpret_cast<float*>(SlotOf(number).buffer.data()); }
  /// Quantized gradients: what number's all-to-all sends and receives.
  std::byte* Sent(uint64_t number) { return SlotOf(number).sent.data(); }
  std::byte* Received(uint64_t number) { return SlotOf(number).received.data(); }
  /// Reducing every micro-step: where number's reduce-scatter writes this rank's shard.
  float* Output(uint64_t number) { return reinterpret_cast<float*>(SlotOf(number).output.data()); }

  /// Completes when reduce-scatter `number` may write its slot.
  Awaitable<void> WaitTurn(uint64_t number);
  /// `number`'s writer is done with its slot (whatever it managed to write: a rank's failure
  /// fails its step, not the collective). Loop thread.
  void MarkFilled(uint64_t number);
  /// Blocks until `number`'s writer is done: the collective's ready function (communicator's
  /// thread). Keyed by number, not by slot or chunk: the communicator may reach a later number
  /// before the loop has seen the earlier one's end.
  Status WaitFilled(uint64_t number);
  /// One of the two ends of `number`'s use of its slot: its writer finished, or its reader (the
  /// collective, or for quantized gradients the sum of what it received). After both, the slot
  /// is the next number's.
  void Release(uint64_t number);

 private:
  struct Slot {
    AlignedBuffer buffer;
    AlignedBuffer sent, received;
    AlignedBuffer output;
    uint64_t turn = 0;  // The number that may use it now (loop thread).
    // The last number whose writer is done, plus one (0: none yet); under filled_mutex_.
    uint64_t filled_end = 0;
  };
  Slot& SlotOf(uint64_t number) { return slots_[number % slots_.size()]; }
  std::vector<Slot> slots_;
  uint64_t next_number_ = 0;  // Trainer thread.
  // Loop thread: releases counted per number (a failed communicator may complete a collective
  // before its writer's turn has come), and the writers waiting for their turn.
  std::map<uint64_t, int> releases_;
  std::map<uint64_t, std::function<void()>> waiting_;
  std::mutex filled_mutex_;
  std::condition_variable filled_;
};

}  // namespace strata::offload
