// What the host budget decides at creation: the buffers each chunk needs in host memory, the
// optimizer states that spill to NVMe when it cannot hold them, and the extra buffers
// speculative updates would like where it has room left. Initialize (engine_placement.cpp)
// calls these in its order.
#include <algorithm>
#include <string>
#include <vector>

#include "engine/engine_impl.h"
#include "engine/host_memory.h"
#include "strata/core/bytes.h"
#include "strata/core/log.h"

namespace strata::offload {

std::vector<Engine::Impl::HostBuffer> Engine::Impl::HostBuffersOf(size_t chunk) {
  Chunk& c = chunks_[chunk];
  const size_t wsize = working_size();
  const std::string name = "chunk " + std::to_string(chunk);
  std::vector<HostBuffer> buffers;
  // Stage 3 keeps this rank's shard of a trained chunk's working parameters (ParamGather).
  const size_t param_bytes = c.param_home_bytes(wsize);
  if (c.placement.params == Tier::kHost) {
    buffers.push_back({&c.host_params, param_bytes, "the parameters of " + name});
  }
  // Frozen chunks have no gradients; device-kept ones keep theirs there.
  if (c.frozen() || c.placement.optimizer_states == Tier::kDevice) return buffers;
  buffers.push_back({&c.grads_landing, c.working_bytes(wsize), "the gradients of " + name});
  if (sums_micro_steps()) {
    buffers.push_back({&c.grads_sum, c.numel * sizeof(float), "the gradient sum of " + name});
  }
  if (sharded()) {
    buffers.push_back({&c.grads_shard, c.shard.numel() * sizeof(float),
                       "this rank's shard of the gradients of " + name});
  }
  if (c.placement.params != Tier::kNvme) {
    buffers.push_back({&c.param_copy, param_bytes, "the updated working parameters of " + name});
  }
  if (options_.optimizer.delayed_update) {
    buffers.push_back(
        {&c.delayed_params, c.working_bytes(wsize),
         "the delayed working parameters of " + name + " (optimizer.delayed_update)"});
  }
  if (c.placement.optimizer_states == Tier::kHost) {
    const bool kept_by_option = options_.placement.max_states_in_host > 0;
    buffers.push_back(
        {&c.host_states, c.state_bytes(),
         "the optimizer states of " + name +
             (kept_by_option ? " (kept there by placement.max_states_in_host: lower it)" : "")});
  }
  return buffers;
}

uint64_t Engine::Impl::HostBytesNeeded() {
  uint64_t bytes = 0;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    for (const HostBuffer& b : HostBuffersOf(i)) {
      if (b.bytes > 0) bytes += AlignUp(b.bytes, kHostAlignment);
    }
  }
  if (const size_t numel = max_nvme_state_numel(); numel > 0) {
    bytes += StagingPoolBytes(ChunkStateBytes(numel), MinStateBuffers(options_.host));
  }
  if (const size_t param_bytes = max_nvme_param_bytes(); param_bytes > 0) {
    bytes += StagingPoolBytes(param_bytes, options_.host.param_buffer_count);
  }
  return bytes;
}

void Engine::Impl::SpillStatesToNvme() {
  const PlacementOptions& place = options_.placement;
  if (place.optimizer_states != Tier::kHost || options_.nvme.paths.empty()) return;
  const uint64_t budget = host_budget_.free_bytes();
  const uint64_t need = HostBytesNeeded();  // No states on NVMe yet: no state staging in it.
  if (need <= budget) return;
  // The chunks to spill for a cap on their size (NVMe states need staging buffers as large as
  // the largest of them): from the last chunk back, skipping larger ones, until the rest fits.
  auto spill_under = [&](size_t cap) {
    std::vector<size_t> spill;
    uint64_t left = need, staging = 0;
    size_t largest = 0;
    for (size_t i = chunks_.size(); i-- > 0 && left > budget;) {
      const Chunk& c = chunks_[i];
      if (c.placement.optimizer_states != Tier::kHost || c.numel > cap) continue;
      spill.push_back(i);
      left -= AlignUp(c.state_bytes(), kHostAlignment);
      largest = std::max(largest, c.numel);
      const uint64_t now =
          StagingPoolBytes(ChunkStateBytes(largest), MinStateBuffers(options_.host));
      left += now - staging;
      staging = now;
    }
    return left <= budget ? spill : std::vector<size_t>{};
  };
  // The smallest cap that fits: a large last chunk (an untied lm_head) stays in host memory
  // when spilling smaller ones is enough, instead of sizing every staging buffer by it.
  std::vector<size_t> sizes;
  for (const Chunk& c : chunks_) {
    if (c.placement.optimizer_states == Tier::kHost) sizes.push_back(c.numel);
  }
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (size_t cap : sizes) {
    const std::vector<size_t> spill = spill_under(cap);
    if (spill.empty()) continue;
    for (size_t i : spill) chunks_[i].placement.optimizer_states = Tier::kNvme;
    Log(LogLevel::kWarning,
        "the host budget of " + FormatBytes(host_budget_.usage().budget_bytes) +
            " cannot hold every chunk's optimizer states: " + std::to_string(spill.size()) +
            (spill.size() == 1 ? " chunk's states spill" : " chunks' states spill") + " to NVMe (" +
            options_.nvme.paths.front() +
            "), the others stay in host memory; raise host.pinned_memory_bytes to keep more");
    return;
  }
  // No spill fits: everything stays, and the host allocation that fails says what.
}

std::optional<AlignedBuffer> Engine::Impl::AllocateWithinBudget(size_t bytes) {
  const uint64_t size = AlignUp(bytes, kHostAlignment);
  if (!host_budget_.TryReserve(size)) return std::nullopt;
  BudgetReservation reserved(&host_budget_, size);
  Result<AlignedBuffer> buffer = AlignedBuffer::Allocate(bytes);
  if (!buffer.ok()) return std::nullopt;  // The reservation goes with it.
  static_reservations_.push_back(std::move(reserved));
  return std::move(*buffer);
}

bool Engine::Impl::Speculates() const {
  // (Several ranks do not speculate yet: docs/architecture.md, "Several ranks".)
  return options_.optimizer.speculative_updates && pipeline_.gated() && !sharded();
}

bool Engine::Impl::WantsStateShadow(const Chunk& c) const {
  return Speculates() && !c.frozen() && c.placement.optimizer_states == Tier::kHost;
}

bool Engine::Impl::WantsParamsBefore(const Chunk& c) const {
  // Rechecking, speculative parameters wait for the verdict on the host (UpdateOnHost): the
  // device never has them to put back.
  return Speculates() && !c.frozen() && c.placement.optimizer_states == Tier::kNvme &&
         c.placement.params == Tier::kDevice && !options_.optimizer.recheck_gradients;
}

uint64_t Engine::Impl::SpeculationBytes() const {
  uint64_t bytes = 0;
  for (const Chunk& c : chunks_) {
    if (WantsStateShadow(c)) bytes += AlignUp(c.state_bytes(), kHostAlignment);
    if (WantsParamsBefore(c)) bytes += AlignUp(c.working_bytes(working_size()), kHostAlignment);
  }
  return bytes;
}

void Engine::Impl::AllocateStateShadows() {
  if (!Speculates()) return;
  size_t wanted = 0, given = 0;
  uint64_t bytes = 0, missing = 0;
  // Backward order: the chunks whose gradients land first have the most backward left to
  // overlap their updates with.
  for (size_t i = chunks_.size(); i-- > 0;) {
    Chunk& c = chunks_[i];
    if (!WantsStateShadow(c)) continue;
    ++wanted;
    const uint64_t size = AlignUp(c.state_bytes(), kHostAlignment);
    // Not zeroed here: WriteMemoryHome fills it with the initial states, as host_states.
    std::optional<AlignedBuffer> shadow = AllocateWithinBudget(c.state_bytes());
    if (!shadow) {
      missing += size;
      continue;
    }
    c.host_state_shadow = std::move(*shadow);
    ++given;
    bytes += size;
  }
  AllocateParamsBefore();
  if (wanted == 0) return;
  std::string message = "speculative updates: " + std::to_string(given) + " of " +
                        std::to_string(wanted) +
                        " chunks with optimizer states in host memory have room for a second "
                        "buffer of them (" +
                        FormatBytes(bytes) + " of host memory) and update during backward";
  if (given < wanted) {
    message += "; the other " + std::to_string(wanted - given) +
               " wait for the global gradient norm at the end of backward (" +
               FormatBytes(missing) +
               " more of host.pinned_memory_bytes would let them update during backward)";
  }
  Log(LogLevel::kInfo, message + "; optimizer.speculative_updates = false saves the buffers");
}

void Engine::Impl::AllocateParamsBefore() {
  // NVMe-kept chunks need no second states (their update goes to shadow extents), but their
  // speculative parameters can go up early if the ones before are kept here, to put back on a
  // roll-back; a chunk without room holds its upload back to the verdict instead. After the
  // host shadows, which decide whether host-kept chunks speculate at all.
  size_t wanted = 0, given = 0;
  uint64_t bytes = 0;
  for (size_t i = chunks_.size(); i-- > 0;) {
    Chunk& c = chunks_[i];
    if (!WantsParamsBefore(c)) continue;
    ++wanted;
    const size_t wbytes = c.working_bytes(working_size());
    std::optional<AlignedBuffer> copy = AllocateWithinBudget(wbytes);
    if (!copy) continue;
    c.params_before = std::move(*copy);
    ++given;
    bytes += AlignUp(wbytes, kHostAlignment);
  }
  if (wanted == 0) return;
  Log(LogLevel::kInfo,
      "speculative updates: " + std::to_string(given) + " of " + std::to_string(wanted) +
          " chunks with optimizer states on NVMe keep their parameters from before an update (" +
          FormatBytes(bytes) + " of host memory) and upload the new ones as soon as they are made" +
          (given < wanted ? "; the others upload theirs once the global gradient norm is known"
                          : ""));
}

}  // namespace strata::offload
