// StatePreloader: the read-ahead of optimizer states kept on NVMe.
//
// A chunk whose optimizer states live on NVMe needs them in host memory for its update. The
// preloader reads them ahead, from the chunk's current extent into a staging buffer of its own
// pool, so that by the time the chunk's gradients have landed its states are there; the update
// takes the buffer, steps the states in it, writes them to the shadow extent from it and gives
// it back, which lets the next read ahead start. Each chunk has one slot: no read, a read in
// flight, or a read done and waiting for its update.
//
// The policy (Start): in the order backward produces gradients (the last chunk first), the
// chunks whose update still has to read its states, as many as the pool allows less one, which
// stays free for a chunk that arrives out of the expected order. The pool is sized once by the
// engine's placement (Engine::Impl::Initialize, with StateBufferCount from host_memory.h: the
// host.optimizer_buffer_count, or what the host budget has left).
//
// Model: RocksDB's FilePrefetchBuffer (a read-ahead owned by one reader, with its own buffers
// and policy).
//
// Threads: the loop thread only, like the LoopStagingPool it owns; it takes no lock. It reads
// the chunks' phases and micro-step counts (the pipeline's ChunkStep) as the step pipeline's
// loop code does.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "engine/chunk.h"
#include "engine/engine_metrics.h"
#include "engine/loop_sync.h"
#include "strata/core/event_loop.h"
#include "strata/core/staging_pool.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_space.h"

namespace strata::offload {

struct ChunkStep;  // chunk_step.h: private to the step's files.

class StatePreloader {
 public:
  /// Starts a coroutine on the event loop, counted until it ends (Engine::Impl::Spawn).
  using Spawner = std::function<void(Awaitable<void>)>;

  /// `chunks`, `steps` (the pipeline's, one per chunk) and `metrics` must outlive the
  /// preloader; `chunks` and `steps` are read once it is Open.
  StatePreloader(const std::vector<Chunk>& chunks, const std::vector<ChunkStep>& steps,
                 EngineMetrics& metrics, Spawner spawn)
      : chunks_(chunks), steps_(steps), metrics_(metrics), spawn_(std::move(spawn)) {}

  /// The buffers read ahead out of `buffer_count`: one stays free for a chunk that arrives out
  /// of the expected order.
  static size_t ReadAheadDepth(size_t buffer_count) { return buffer_count - 1; }

  /// Takes the staging pool the reads go into (every buffer as large as the largest NVMe-kept
  /// chunk's states) and the swap space they come from, which must outlive the preloader's
  /// reads, and registers the pool's buffers with `io` as fixed buffers where it can. Once,
  /// after the chunks are laid out and before anything runs on the loop. Without it (no states
  /// on NVMe) the preloader reads nothing.
  void Open(std::unique_ptr<StagingPool> pool, nvme::IoEngine& io, nvme::SwapSpace& swap);

  /// Starts the reads ahead that the policy (see the top of this file) allows now; called
  /// whenever a buffer comes back. `participants_known`: Step() was called and its commit has
  /// not begun, so a chunk without gradients this step (micro_steps 0) sits the step out and
  /// reads nothing; at the commit every count is reset for the next step, whose chunks are the
  /// ones to read.
  void Start(bool participants_known);
  /// `chunk`'s states, read from its current extent: its read ahead, or a read started now,
  /// once done. The buffer is the caller's until Return; a failed read returns its status.
  Awaitable<Result<StagingBuffer>> Take(size_t chunk);
  /// Gives back a buffer Take returned (an empty one is fine). Starts nothing: Start does.
  void Return(StagingBuffer& buffer);
  /// The io_uring fixed-buffer index of a buffer Take returned, for a write from it; -1 when
  /// the pool is not registered.
  int FixedBufferIndex(const StagingBuffer& buffer) const {
    return registered_ ? int(buffer.index()) : -1;
  }
  /// Drops `chunk`'s read ahead, if it has one: waits for it if in flight and returns its
  /// buffer (a chunk that sits a step out must not hold one that the step's updates need).
  Awaitable<void> Drop(size_t chunk);
  /// The same for every chunk: what a switch to new states (their reads are stale) and the
  /// engine's destruction (the buffers go back before the pool does) need.
  Awaitable<void> DropAll();

 private:
  /// One chunk's read ahead.
  struct Slot {
    bool active = false;  // A read was started and its buffer not yet taken or dropped.
    bool done = false;    // The read has finished (`ready` holds its unit).
    Status status;
    StagingBuffer buffer;
    std::optional<LoopSemaphore> ready;  // Released once the read is done.
  };

  void StartRead(size_t chunk);
  Awaitable<void> Read(size_t chunk);

  const std::vector<Chunk>& chunks_;
  const std::vector<ChunkStep>& steps_;
  EngineMetrics& metrics_;
  Spawner spawn_;
  std::optional<LoopStagingPool> pool_;  // Set by Open.
  nvme::SwapSpace* swap_ = nullptr;      // Set by Open.
  bool registered_ = false;              // The pool's buffers are io_uring fixed buffers.
  std::vector<Slot> slots_;              // One per chunk (sized by Open).
};

}  // namespace strata::offload
