// Reading and writing parameters' optimizer states between steps (one rank; several ranks:
// sharded_state_access.cpp): each chunk's states read from and written to where they live, and
// the switch that makes new NVMe-home state current. Checkpoints use the same homes
// (checkpoint/engine_checkpoint.cpp).
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_manifest.h"
#include "engine/engine_impl.h"
#include "sharding/rank_agreement.h"
#include "step/state_batches.h"

namespace strata::offload {

Status Engine::Impl::ReadChunkStates(size_t chunk, std::byte* out) {
  const Chunk& c = chunks_[chunk];
  if (c.frozen()) return ReadFrozenValues(chunk, reinterpret_cast<float*>(out));
  switch (*c.placement.optimizer_states) {
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(device_.CopyToHost(out, c.device_states.data(), c.state_bytes()));
      return device_.SynchronizeStream(Stream::kDeviceToHost);
    case Tier::kHost: std::memcpy(out, c.host_states.data(), c.state_bytes()); return Status();
    case Tier::kNvme: return swap_->ReadSync(c.state_extent(), out);
  }
  return Internal("unknown tier");
}

Status Engine::Impl::ReadFrozenValues(size_t chunk, float* out) {
  const Chunk& c = chunks_[chunk];
  // Exactly the chunk's bytes: the buffer is rounded up to whole pages, device memory is not.
  const size_t bytes = c.working_bytes(working_size());
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer working, AlignedBuffer::Allocate(bytes));
  switch (c.placement.params) {
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(device_.CopyToHost(working.data(), c.params.data(), bytes));
      STRATA_RETURN_IF_ERROR(device_.SynchronizeStream(Stream::kDeviceToHost));
      break;
    case Tier::kHost: std::memcpy(working.data(), c.host_params.data(), bytes); break;
    case Tier::kNvme:
      STRATA_RETURN_IF_ERROR(swap_->ReadSync(c.param_extent(), working.data()));
      break;
  }
  DTypeToFp32(working.data(), working_dtype(), {out, c.numel});
  return Status();
}

namespace {

/// Working parameters: `master` rounded.
Result<AlignedBuffer> WorkingParams(std::span<const float> master, DType dtype) {
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer working,
                          AlignedBuffer::Allocate(master.size() * DTypeSize(dtype)));
  Fp32ToDType(master, dtype, working.data());
  return working;
}

const float* MasterOf(const std::byte* states) { return reinterpret_cast<const float*>(states); }

}  // namespace

Status Engine::Impl::WriteNvmeHome(size_t chunk, const std::byte* states, bool shadow) {
  Chunk& c = chunks_[chunk];
  if (c.placement.optimizer_states == Tier::kNvme) {
    const nvme::ExtentId extent = shadow ? c.state_shadow() : c.state_extent();
    STRATA_RETURN_IF_ERROR(swap_->WriteSync(extent, states, c.state_bytes()));
  }
  if (c.placement.params == Tier::kNvme) {
    // The states' master is this rank's shard, which is all that stage 3 keeps at home (one
    // rank: the whole chunk; frozen: its values).
    STRATA_ASSIGN_OR_RETURN(
        AlignedBuffer working,
        WorkingParams({MasterOf(states), c.param_home_numel()}, working_dtype()));
    const nvme::ExtentId extent = shadow ? c.param_shadow() : c.param_extent();
    STRATA_RETURN_IF_ERROR(
        swap_->WriteSync(extent, working.data(), c.param_home_bytes(working_size())));
  }
  return Status();
}

Status Engine::Impl::WriteMemoryHome(size_t chunk, const std::byte* states, const float* master) {
  Chunk& c = chunks_[chunk];
  // Everything that can fail before the first byte changes.
  Result<AlignedBuffer> working = AlignedBuffer();
  if (c.placement.params != Tier::kNvme) {
    working =
        WorkingParams({master != nullptr ? master : MasterOf(states), c.numel}, working_dtype());
  }
  STRATA_RETURN_IF_ERROR(working.status());
  if (c.placement.optimizer_states == Tier::kDevice) {
    STRATA_RETURN_IF_ERROR(device_.CopyToDevice(c.device_states.data(), states, c.state_bytes()));
    STRATA_RETURN_IF_ERROR(device_.SynchronizeStream(Stream::kHostToDevice));
  } else if (c.placement.optimizer_states == Tier::kHost) {
    std::memcpy(c.host_states.data(), states, c.state_bytes());
    // The shadow too: an update out of place rewrites only the states its optimizer has, so
    // the rest (and a shadow never written yet) must already hold these values.
    if (!c.host_state_shadow.empty()) {
      std::memcpy(c.host_state_shadow.data(), states, c.state_bytes());
    }
  }
  if (c.placement.params == Tier::kNvme) return Status();
  if (c.placement.params == Tier::kHost) {
    const size_t wsize = working_size();
    if (c.params_sharded) {  // Stage 3: this rank's shard only.
      std::memcpy(c.host_params.data(), working->data() + c.shard.begin * wsize,
                  c.shard.numel() * wsize);
    } else {
      std::memcpy(c.host_params.data(), working->data(), c.working_bytes(wsize));
    }
    return Status();
  }
  STRATA_RETURN_IF_ERROR(
      device_.CopyToDevice(c.params.data(), working->data(), c.working_bytes(working_size())));
  // These supersede parameters a delayed step held back, if any are left (Load; between steps,
  // so no Release or commit looks now).
  pipeline_.DropDelayedParameters(chunk);
  return device_.SynchronizeStream(Stream::kHostToDevice);
}

namespace {

/// InvalidArgument unless `parameter` exists and `size` is its element count.
Status CheckParameter(const ChunkLayout& layout, size_t parameter, size_t size) {
  if (parameter >= layout.parameter_count()) {
    return InvalidArgument("parameter " + std::to_string(parameter) + " does not exist");
  }
  const size_t numel = layout.location(parameter).numel;
  if (size != numel) {
    return InvalidArgument("parameter '" + layout.name(parameter) + "' has " +
                           std::to_string(numel) + " elements; the buffer holds " +
                           std::to_string(size));
  }
  return Status();
}

/// FailedPrecondition for a moment of a frozen parameter: it has none.
Status CheckHasState(const ChunkLayout& layout, const Chunk& c, size_t parameter,
                     ParameterState state) {
  if (c.frozen() && state != ParameterState::kMaster) {
    return FailedPrecondition("parameter '" + layout.name(parameter) +
                              "' is frozen: it has no optimizer moments, only its value");
  }
  return Status();
}

}  // namespace

Status Engine::Impl::CheckReads(std::span<const ParameterStateRead> reads) {
  for (const ParameterStateRead& r : reads) {
    STRATA_RETURN_IF_ERROR(CheckParameter(layout_, r.parameter, r.out.size()));
    const size_t chunk = layout_.location(r.parameter).chunk;
    STRATA_RETURN_IF_ERROR(pipeline_.CheckReadable(chunk, "reading a parameter's state"));
    STRATA_RETURN_IF_ERROR(CheckHasState(layout_, chunks_[chunk], r.parameter, r.state));
  }
  return Status();
}

Status Engine::Impl::CheckWrites(std::span<const ParameterStateWrite> writes) {
  for (const ParameterStateWrite& w : writes) {
    STRATA_RETURN_IF_ERROR(CheckParameter(layout_, w.parameter, w.values.size()));
    const size_t chunk = layout_.location(w.parameter).chunk;
    STRATA_RETURN_IF_ERROR(CheckHasState(layout_, chunks_[chunk], w.parameter, w.state));
  }
  STRATA_RETURN_IF_ERROR(pipeline_.CheckBetweenSteps("WriteParameterState"));
  if (std::optional<size_t> held = residency_.FirstAcquired()) {
    return FailedPrecondition("WriteParameterState while chunk " + std::to_string(*held) +
                              " is acquired; Release every chunk first");
  }
  return pipeline_.FlushDelayedParameters();
}

Status Engine::Impl::ReadParameterStates(std::span<const ParameterStateRead> reads) {
  if (sharded()) return ReadShardedParameterStates(reads);
  STRATA_RETURN_IF_ERROR(CheckReads(reads));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer states, AlignedBuffer::Allocate(max_state_bytes()));
  for (const auto& [chunk, indices] : internal::ByChunk(layout_, reads)) {
    const Chunk& c = chunks_[chunk];
    STRATA_RETURN_IF_ERROR(ReadChunkStates(chunk, states.data()));
    for (size_t i : indices) {
      const ParameterStateRead& r = reads[i];
      const ParameterLocation& loc = layout_.location(r.parameter);
      const float* values =
          reinterpret_cast<const float*>(states.data()) + size_t(r.state) * c.numel + loc.offset;
      std::copy(values, values + loc.numel, r.out.begin());
    }
  }
  return Status();
}

Status Engine::Impl::WriteParameterStates(std::span<const ParameterStateWrite> writes) {
  if (sharded()) return WriteShardedParameterStates(writes);
  STRATA_RETURN_IF_ERROR(CheckWrites(writes));
  // Fetches and read-ahead in flight finish once, before the first chunk's memory home is
  // written; nothing starts new ones until the switch at the end (as Load does). Switching per
  // chunk would restart the read-ahead of every NVMe chunk once per chunk written.
  STRATA_RETURN_IF_ERROR(WaitForQuietMemory());
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer states, AlignedBuffer::Allocate(max_state_bytes()));
  std::vector<size_t> written;
  Status status;
  for (const auto& [chunk, indices] : internal::ByChunk(layout_, writes)) {
    const Chunk& c = chunks_[chunk];
    status = ReadChunkStates(chunk, states.data());
    if (!status.ok()) break;
    for (size_t i : indices) {
      const ParameterStateWrite& w = writes[i];
      const ParameterLocation& loc = layout_.location(w.parameter);
      std::copy(w.values.begin(), w.values.end(),
                reinterpret_cast<float*>(states.data()) + size_t(w.state) * c.numel + loc.offset);
    }
    // NVMe-home state goes to the shadow extents, which only the switch makes current.
    status = WriteNvmeHome(chunk, states.data(), /*shadow=*/true);
    if (!status.ok()) break;
    status = WriteMemoryHome(chunk, states.data());
    if (!status.ok()) {
      // Memory homes are written in place: this chunk may be part old, part new.
      written.push_back(chunk);
      status = status.WithContext("chunk " + std::to_string(chunk) +
                                  " may be partly written; write its states again");
      break;
    }
    written.push_back(chunk);
  }
  if (!written.empty()) STRATA_RETURN_IF_ERROR(SwitchToNewState(written));
  return status.ok() ? status : status.WithContext("writing parameter states");
}

Status Engine::Impl::SetStepCount(int64_t steps) {
  Status ready;
  if (steps < 0 || steps > internal::kMaxCheckpointCount) {
    ready = InvalidArgument("step count " + std::to_string(steps) + " is outside [0, 2^53] (what " +
                            "a checkpoint holds)");
  }
  if (ready.ok()) ready = pipeline_.CheckBetweenSteps("SetStepCount");
  if (ready.ok()) {
    if (std::optional<size_t> held = residency_.FirstAcquired()) {
      ready = FailedPrecondition("SetStepCount while chunk " + std::to_string(*held) +
                                 " is acquired; Release every chunk first");
    }
  }
  if (sharded()) {
    // Every rank's chunks count the same steps.
    const std::string what = "setting the step count across ranks";
    const uint64_t word = uint64_t(steps);
    STRATA_RETURN_IF_ERROR(AgreeOnCall({&word, 1}, what));
    ready = internal::AgreeAcrossRanks(*environment_.communicator, ready, what);
  }
  STRATA_RETURN_IF_ERROR(ready);
  // Frozen chunks take no steps (as Load leaves them).
  std::vector<int64_t> chunk_steps(chunks_.size(), steps);
  for (size_t i = 0; i < chunks_.size(); ++i) {
    if (chunks_[i].frozen()) chunk_steps[i] = 0;
  }
  pipeline_.Restore(pipeline_.scaler_state(), steps, chunk_steps);
  return Status();
}

Status Engine::Impl::WaitForQuietMemory() {
  param_gather_.Discard();  // Stage 3: gathers in flight read the parameter shards.
  WaitIdle();               // Fetches in flight read host-home parameters.
  return residency_.WaitForTrainerUse();
}

Status Engine::Impl::SwitchToNewState(const std::vector<size_t>& chunks) {
  // Device copies of offloaded parameters are stale (the trainer's work on them has run, see
  // WaitForQuietMemory); fetches and preloads read the current extents, so the switch happens on
  // the loop.
  auto switch_over = [this, &chunks]() -> Awaitable<void> {
    co_await pipeline_.preloader().DropAll();
    for (size_t i : chunks) chunks_[i].FlipNvmeShadows();
    residency_.Drop(chunks);
    pipeline_.preloader().Start(/*participants_known=*/false);  // Between steps.
  };
  loop_.Run(switch_over());
  return Status();
}

}  // namespace strata::offload
