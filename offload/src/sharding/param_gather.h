// ParamGather: ZeRO stage 3's parameter all-gathers. Each rank keeps only its shard of a trained
// chunk's working parameters, in host memory (Chunk::host_params) or on NVMe (ZeRO-Infinity's
// offload_param nvme: the chunk's current parameter extent); Acquire gathers the whole chunk from
// every rank's shard into one of a few host slots, and Residency fetches it to the device from
// there.
//
// Collectives go in one order on every rank, so what is gathered, and when, follows only the
// trainer's calls, never what the device happens to hold (which depends on timing): every
// Acquire of a chunk the trainer does not already hold gathers it — forward's and backward's,
// the 2Ψ of ZeRO-3's 3Ψ — and gathers the chunks the recorded order expects next as far as the
// free slots go (prefetch). A gather made for an Acquire that never came (the trainer held the
// chunk, or left the order) is thrown away when a step or a Load changes the parameters.
//
// An NVMe-home shard is read into its slot on the communicator's thread as the gather's turn
// comes, not on the trainer's: an Acquire enqueues the gathers of the chunks after it, whose
// reads would otherwise hold up forward. The read is part of the gather: a failed one fails the
// Take that waits for it, and this rank still takes part in the collective.
//
// With placement.quantized_weights (ZeRO++'s qwZ), each rank quantizes its shard to blockwise
// int8 (CpuOptimizer::Quantize) on the communicator's thread too, and every rank dequantizes all
// the shards it received when the trainer takes them: the same bytes give every rank the same
// parameters.
//
// Threads: the trainer thread makes every call; the communicator's thread reads and quantizes a
// slot's shard and opens its signal when its gather is done.
//
// It works with what Resources, Initialize and Connect hand it, not with the engine as a whole.
#pragma once

#include <cstddef>
#include <deque>
#include <optional>
#include <span>
#include <vector>

#include "engine/chunk.h"
#include "engine/engine_metrics.h"
#include "engine/thread_signal.h"
#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"
#include "strata/core/device.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "strata/nvme/swap_space.h"
#include "strata/offload/communicator.h"
#include "strata/offload/engine.h"

namespace strata::offload {

class ParamGather {
 public:
  /// Width of quantized weights: int8, as DeepSpeed's qwZ.
  static constexpr int kWeightBits = 8;

  /// What ParamGather works with from its creation, all owned by the engine (Engine::Impl) and
  /// outliving it.
  struct Resources {
    const EngineOptions& options;
    Device& device;  // Pins the slots.
    /// Every chunk's storage, laid out by the placement before SlotExtraBytes; read only here.
    const std::vector<Chunk>& chunks;
    int ranks;  // The ranks the chunks are sharded across.
    EngineMetrics& metrics;
  };

  explicit ParamGather(Resources resources);

  /// `slots` host buffers of `slot_bytes` each (the largest trained chunk's working parameters)
  /// and, for quantized gathers, SlotExtraBytes(shard_numel) beside each. The caller has
  /// reserved them on the host budget.
  Status Initialize(size_t slots, size_t slot_bytes, size_t shard_numel);
  /// Host bytes a slot takes besides its parameters, for shards of up to `shard_numel`
  /// elements (the largest trained chunk's; every rank's is as large): the shard read from
  /// NVMe (with NVMe-home parameters), the quantized shard it sends and the ranks' quantized
  /// shards it receives (with placement.quantized_weights).
  size_t SlotExtraBytes(size_t shard_numel) const;
  /// What the gathers run on, once the engine has made them (after Initialize): the
  /// communicator, the swap space NVMe-home shards are read from (null when none are) and the
  /// optimizer, whose threads quantize and dequantize. All outlive the gathers (the engine
  /// drains the communicator first).
  void Connect(Communicator& communicator, nvme::SwapSpace* swap,
               cpu_adam::CpuOptimizer& optimizer);

  /// The whole of `chunk`'s working parameters, blocking until they are gathered: its gather
  /// was prefetched, or is enqueued now; then the gathers of `upcoming` (the chunks expected
  /// next, in order) that free slots allow. Valid until Return(chunk). The first failed
  /// collective's error (the communicator stays failed).
  Result<const std::byte*> Take(size_t chunk, std::span<const size_t> upcoming);
  /// Residency has copied what Take returned: its slot is free.
  void Return(size_t chunk);
  /// The parameters are about to change (a step, a Load): prefetched gathers are stale. Blocks
  /// until every gather in flight has stopped reading the shards and writing the slots.
  void Discard();
  /// An Acquire failed on this rank after its gather, which the other ranks took part in and
  /// went on from: every later Take refuses, naming `error`, rather than gather out of step
  /// with them. (Take calls it itself when this rank's own part of a gather fails.)
  void Fail(const Status& error);

 private:
  struct Slot {
    AlignedBuffer buffer;
    PinnedHostRegion pinned;   // For the copy to the device; unpinned before it is freed.
    AlignedBuffer nvme_shard;  // NVMe-home parameters: this rank's shard, read for the gather.
    // Quantized gathers: this rank's shard quantized, and every rank's as gathered.
    AlignedBuffer quantized_shard;
    AlignedBuffer quantized_shards;
    // Of reading and quantizing this rank's shard (communicator's thread, as its gather).
    Status prepare_status;
    std::optional<size_t> chunk;  // What it holds or is gathering; empty when free.
    bool taken = false;           // Between Take and Return.
    bool in_flight = false;       // A gather was enqueued into it and not waited for since.
    ThreadSignal gathered;        // Opened by the communicator with the gather's status.
  };

  bool reads_nvme() const;  // Some trained chunk's shard is NVMe-home.
  Slot* Find(size_t chunk);
  Slot* FreeSlot();
  /// Enqueues the all-gather of `chunk` into `slot`, after the slot's previous one is done.
  void Enqueue(Slot& slot, size_t chunk);
  bool quantized() const;
  /// Dequantizes what a quantized gather of `chunk` received into the slot's parameters.
  Status Dequantize(Slot& slot, size_t chunk);
  static void WaitIdle(Slot& slot);

  DType working_dtype() const { return options_.precision.working_dtype; }
  size_t working_size() const { return DTypeSize(working_dtype()); }

  const EngineOptions& options_;
  Device& device_;
  const std::vector<Chunk>& chunks_;
  const int ranks_;
  EngineMetrics& metrics_;
  Communicator* communicator_ = nullptr;  // Set by Connect, like what follows.
  nvme::SwapSpace* swap_ = nullptr;
  cpu_adam::CpuOptimizer* optimizer_ = nullptr;
  std::deque<Slot> slots_;  // Never moved: the communicator writes into them.
  Status failed_;           // Set by Fail (trainer thread).
};

}  // namespace strata::offload
