// Parameter-state access with several ranks (Engine::Impl::ReadShardedParameterStates,
// WriteShardedParameterStates, AgreeOnCall): each rank holds its shard of every trained chunk's
// states, so a read gathers the shards and a write changes each rank's part. Both are
// collectives, as FSDP's full state_dict is: every rank makes the same call, and each chunk
// runs the same gathers and agreements on every rank, whatever failed where, so that no rank
// waits for a collective another skipped.
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "engine/engine_impl.h"
#include "sharding/rank_agreement.h"
#include "step/state_batches.h"

namespace strata::offload {

Status Engine::Impl::AgreeOnCall(std::span<const uint64_t> words, const std::string& what) {
  const uint64_t mine = XXH3_64bits(words.data(), words.size_bytes());
  std::vector<uint64_t> all(static_cast<size_t>(ranks()));
  STRATA_RETURN_IF_ERROR(
      environment_.communicator->AllGatherNow({&mine, 1}, all).WithContext(what));
  std::string differ;
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] != all[0]) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  }
  if (differ.empty()) return Status();
  return InvalidArgument(what + ": rank " + differ + " of " + std::to_string(ranks()) +
                         " asked for other parameters or states than rank 0 (or gave other values "
                         "or another step count); with several ranks every rank makes the same "
                         "call, as with FSDP's full state_dict");
}

namespace {

/// The buffers a sharded access works in: this rank's states of one chunk, and one state of a
/// whole chunk gathered from every rank.
struct ShardBuffers {
  AlignedBuffer states;
  AlignedBuffer whole;
};

Result<ShardBuffers> AllocateShardBuffers(size_t state_bytes, size_t chunk_numel) {
  ShardBuffers buffers;
  STRATA_ASSIGN_OR_RETURN(buffers.states, AlignedBuffer::Allocate(state_bytes));
  STRATA_ASSIGN_OR_RETURN(buffers.whole, AlignedBuffer::Allocate(chunk_numel * sizeof(float)));
  return buffers;
}

}  // namespace

Status Engine::Impl::ReadShardedParameterStates(std::span<const ParameterStateRead> reads) {
  Communicator& comm = *environment_.communicator;
  const std::string what = "reading parameter states across ranks";
  STRATA_RETURN_IF_ERROR(AgreeOnCall(internal::BatchWords(reads), what));
  Result<ShardBuffers> buffers = AllocateShardBuffers(max_state_bytes(), layout_.max_chunk_numel());
  Status ready = CheckReads(reads);
  if (ready.ok()) ready = buffers.status();
  STRATA_RETURN_IF_ERROR(internal::AgreeAcrossRanks(comm, ready, what));
  const auto* mine = reinterpret_cast<const float*>(buffers->states.data());
  auto* gathered = reinterpret_cast<float*>(buffers->whole.data());
  for (const auto& [chunk, indices] : internal::ByChunk(layout_, reads)) {
    const Chunk& c = chunks_[chunk];
    STRATA_RETURN_IF_ERROR(
        internal::AgreeAcrossRanks(comm, ReadChunkStates(chunk, buffers->states.data()),
                                   what + " (chunk " + std::to_string(chunk) + ")"));
    std::array<bool, 3> wanted = {};
    for (size_t i : indices) wanted[size_t(reads[i].state)] = true;
    for (size_t state = 0; state < wanted.size(); ++state) {
      if (!wanted[state]) continue;
      // Every rank holds a frozen chunk whole (its values only); a trained one's shards are
      // gathered, in rank order: the whole chunk.
      const float* values = mine;
      if (!c.frozen()) {
        const size_t shard = c.shard.numel();
        STRATA_RETURN_IF_ERROR(
            comm.AllGatherNow({mine + state * shard, shard}, {gathered, shard * size_t(ranks())})
                .WithContext(what));
        values = gathered;
      }
      for (size_t i : indices) {
        const ParameterStateRead& r = reads[i];
        if (size_t(r.state) != state) continue;
        const ParameterLocation& loc = layout_.location(r.parameter);
        std::copy(values + loc.offset, values + loc.offset + loc.numel, r.out.begin());
      }
    }
  }
  return Status();
}

Status Engine::Impl::WriteShardedParameterStates(std::span<const ParameterStateWrite> writes) {
  Communicator& comm = *environment_.communicator;
  const std::string what = "writing parameter states across ranks";
  STRATA_RETURN_IF_ERROR(AgreeOnCall(internal::BatchWords(writes), what));
  Result<ShardBuffers> buffers = AllocateShardBuffers(max_state_bytes(), layout_.max_chunk_numel());
  Status ready = CheckWrites(writes);
  if (ready.ok()) ready = buffers.status();
  STRATA_RETURN_IF_ERROR(internal::AgreeAcrossRanks(comm, ready, what));
  // As the single-rank path: in-flight fetches and read-ahead finish before memory homes change.
  // Only once every rank goes on: it throws away stage 3's gathers made ahead, which every rank
  // must do alike or none (the next Acquires would gather out of step).
  STRATA_RETURN_IF_ERROR(internal::AgreeAcrossRanks(comm, WaitForQuietMemory(), what));
  auto* states = reinterpret_cast<float*>(buffers->states.data());
  auto* whole_master = reinterpret_cast<float*>(buffers->whole.data());
  std::vector<size_t> written;
  Status outcome;
  for (const auto& [chunk, indices] : internal::ByChunk(layout_, writes)) {
    const Chunk& c = chunks_[chunk];
    const std::string context = what + " (chunk " + std::to_string(chunk) + ")";
    // This rank's part of each write: a frozen chunk is whole on every rank; a trained one's
    // shard holds elements [shard.begin, shard.end) of each state.
    Status read = ReadChunkStates(chunk, buffers->states.data());
    if (read.ok()) {
      const size_t begin = c.frozen() ? 0 : c.shard.begin;
      const size_t end = c.frozen() ? c.numel : c.shard.end;
      for (size_t i : indices) {
        const ParameterStateWrite& w = writes[i];
        const ParameterLocation& loc = layout_.location(w.parameter);
        const size_t from = std::max(begin, loc.offset);
        const size_t to = std::min(end, loc.offset + loc.numel);
        if (from >= to) continue;
        std::copy(w.values.begin() + long(from - loc.offset),
                  w.values.begin() + long(to - loc.offset),
                  states + size_t(w.state) * (end - begin) + (from - begin));
      }
    }
    outcome = internal::AgreeAcrossRanks(comm, read, context);
    if (!outcome.ok()) break;
    // The working parameters are rounded from the whole chunk's master: every rank's shard.
    const float* master = nullptr;
    if (!c.frozen()) {
      const size_t shard = c.shard.numel();
      outcome = comm.AllGatherNow({states, shard}, {whole_master, shard * size_t(ranks())})
                    .WithContext(context);
      if (!outcome.ok()) break;
      master = whole_master;
    }
    // NVMe-home state goes to the shadow extents, which only the switch below makes current;
    // memory homes are written in place, so only once every rank's shadow write succeeded (a
    // rank whose drive failed must not keep the old chunk while the others take the new).
    outcome = internal::AgreeAcrossRanks(
        comm, WriteNvmeHome(chunk, buffers->states.data(), /*shadow=*/true), context);
    if (!outcome.ok()) break;
    Status wrote = WriteMemoryHome(chunk, buffers->states.data(), master);
    written.push_back(chunk);
    if (!wrote.ok()) {
      wrote = wrote.WithContext("this chunk may be partly written; write its states again");
    }
    outcome = internal::AgreeAcrossRanks(comm, wrote, context);
    if (!outcome.ok()) break;
  }
  if (!written.empty()) STRATA_RETURN_IF_ERROR(SwitchToNewState(written));
  return outcome;
}

}  // namespace strata::offload
