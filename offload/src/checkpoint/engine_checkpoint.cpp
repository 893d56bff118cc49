// Checkpoints: every chunk's optimizer states (fp32 master | exp_avg | exp_avg_sq) in a file of
// its own, plus a manifest with the layout, step count and loss scaler. Working parameters are
// not saved: they are the master rounded to the working dtype, recomputed on load. A frozen
// chunk, which has no states, saves its working parameters widened to fp32 (exact). The files
// go through checkpoint_files.h, which makes the whole directory appear atomically.
#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <string>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/checkpoint_manifest.h"
#include "engine/engine_impl.h"
#include "sharding/rank_agreement.h"

namespace strata::offload {
using internal::ChunkFileName;
using nlohmann::json;

namespace {

/// A manifest entry of one file: its name, size and hash.
json FileEntry(const std::string& name, const internal::FileDigest& digest) {
  return {{"file", name}, {"bytes", digest.bytes}, {"xxh3", digest.xxh3}};
}

}  // namespace

Status Engine::Impl::WriteChunkFiles(internal::CheckpointWriter& writer,
                                     std::vector<internal::FileDigest>& digests,
                                     const SaveOptions& save_options) {
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer states, AlignedBuffer::Allocate(max_state_bytes()));
  // Every rank holds a frozen chunk whole: one saves it, the ranks taking turns (a large frozen
  // base is not all the first rank's to write).
  auto mine = [&](size_t i) { return !chunks_[i].frozen() || rank() == FrozenChunkSaver(i); };
  size_t total = 0, done = 0;
  for (size_t i = 0; i < chunks_.size(); ++i) total += mine(i) ? 1 : 0;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    if (!mine(i)) continue;
    // One chunk at a time through one buffer: saving never needs the whole model in memory.
    STRATA_RETURN_IF_ERROR(ReadChunkStates(i, states.data()));
    const std::string name = sharded() && !c.frozen()
                                 ? internal::ChunkShardFileName(i, rank(), ranks())
                                 : ChunkFileName(i);
    STRATA_ASSIGN_OR_RETURN(internal::CheckpointFileSink sink, writer.CreateFile(name));
    STRATA_RETURN_IF_ERROR(sink.Append({states.data(), c.state_bytes()}));
    STRATA_ASSIGN_OR_RETURN(digests[i], sink.Finish());
    if (save_options.on_chunk_saved) save_options.on_chunk_saved(++done, total);
  }
  return Status();
}

json Engine::Impl::CheckpointManifest(std::span<const internal::FileDigest> digests) const {
  json manifest = internal::NewManifest();
  // One rank writes the first version, which every build reads; shard files need the second.
  manifest["version"] = sharded() ? internal::kShardedCheckpointVersion : 1;
  const LossScalerState scaler = pipeline_.scaler_state();
  manifest["engine"] = {{"step_count", pipeline_.step_count()},
                        {"working_dtype", DTypeName(working_dtype())},
                        {"chunk_bytes", options_.placement.chunk_bytes},
                        {"optimizer", OptimizerTypeName(options_.optimizer.type)},
                        {"loss_scaler",
                         {{"scale", scaler.scale},
                          {"iteration", scaler.iteration},
                          {"last_overflow_iteration", scaler.last_overflow_iteration},
                          {"hysteresis_left", scaler.hysteresis_left}}}};
  if (sharded()) manifest["engine"]["world_size"] = ranks();
  json parameters = json::array();
  for (size_t p = 0; p < layout_.parameter_count(); ++p) {
    const ParameterLocation& loc = layout_.location(p);
    parameters.push_back({{"name", layout_.name(p)},
                          {"shape", layout_.shape(p)},
                          {"chunk", loc.chunk},
                          {"offset", loc.offset}});
  }
  manifest["parameters"] = std::move(parameters);
  json chunks = json::array();
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    json chunk = {
        {"numel", c.numel}, {"frozen", c.frozen()}, {"steps", pipeline_.ChunkStepsTaken(i)}};
    if (sharded() && !c.frozen()) {
      // digests holds every rank's, rank by rank.
      json shards = json::array();
      for (int r = 0; r < ranks(); ++r) {
        shards.push_back(FileEntry(internal::ChunkShardFileName(i, r, ranks()),
                                   digests[size_t(r) * chunks_.size() + i]));
      }
      chunk["shards"] = std::move(shards);
    } else {
      const size_t saver = sharded() ? size_t(FrozenChunkSaver(i)) : 0;
      chunk.update(FileEntry(ChunkFileName(i), digests[saver * chunks_.size() + i]));
    }
    chunks.push_back(std::move(chunk));
  }
  manifest["chunks"] = std::move(chunks);
  return manifest;
}

uint64_t Engine::Impl::CheckpointBytes() const {
  uint64_t bytes = 0;
  for (const Chunk& c : chunks_) {
    bytes += c.frozen() ? c.state_bytes() : c.state_bytes() * uint64_t(ranks());
  }
  return bytes;
}

Status Engine::Impl::CheckSaveTarget(const std::filesystem::path& dir) const {
  const Status mine = internal::CheckCheckpointTarget(dir, CheckpointBytes());
  if (!sharded()) return mine;
  // A rank whose view differs (a path that is not on a shared file system) fails every rank,
  // here, rather than leaving the others in the first step's collectives.
  return internal::AgreeAcrossRanks(*environment_.communicator, mine,
                                    "checking the checkpoint path " + dir.string());
}

Status Engine::Impl::Save(const std::filesystem::path& dir, const SaveOptions& save_options) {
  Status ready = pipeline_.CheckBetweenSteps("Save");
  if (ready.ok()) ready = pipeline_.FlushDelayedParameters();
  const uint64_t bytes_needed = CheckpointBytes();
  // Past the check in Begin the disk can still fill (another writer): the error then says how
  // much this checkpoint needed too.
  const std::string context =
      "writing a checkpoint of " + FormatBytes(bytes_needed) + " to " + dir.string();
  if (!sharded()) {
    STRATA_RETURN_IF_ERROR(ready);
    STRATA_ASSIGN_OR_RETURN(internal::CheckpointWriter writer,
                            internal::CheckpointWriter::Begin(dir, bytes_needed));
    std::vector<internal::FileDigest> digests(chunks_.size());
    Status saved = WriteChunkFiles(writer, digests, save_options);
    if (saved.ok()) saved = writer.Commit(CheckpointManifest(digests));
    return saved.WithContext(context);
  }
  return SaveSharded(dir, bytes_needed, ready, save_options).WithContext(context);
}

Status Engine::Impl::SaveSharded(const std::filesystem::path& dir, uint64_t bytes_needed,
                                 Status ready, const SaveOptions& save_options) {
  // Every rank writes its files into one staging directory, the first rank's; that rank commits
  // the whole set with one rename once every rank's files are durable, so no checkpoint is
  // visible before all of it is. Each collective below is an agreement every rank reaches at
  // the same point, whatever failed where: no rank is left waiting for another.
  Communicator& comm = *environment_.communicator;
  std::optional<internal::CheckpointWriter> writer;
  if (rank() == 0 && ready.ok()) {
    Result<internal::CheckpointWriter> begun = internal::CheckpointWriter::Begin(dir, bytes_needed);
    if (begun.ok()) writer.emplace(std::move(*begun));
    ready = begun.status();
  }
  STRATA_RETURN_IF_ERROR(internal::AgreeAcrossRanks(comm, ready, "beginning the checkpoint"));
  std::vector<double> pid = {rank() == 0 ? double(writer->staging_pid()) : 0.0};
  STRATA_RETURN_IF_ERROR(comm.AllReduceSum(pid).WithContext("sharing the staging directory"));
  Status wrote;
  if (rank() != 0) {
    Result<internal::CheckpointWriter> joined =
        internal::CheckpointWriter::Join(dir, int64_t(pid[0]));
    if (joined.ok()) writer.emplace(std::move(*joined));
    wrote = joined.status();
  }
  std::vector<internal::FileDigest> mine(chunks_.size());
  if (wrote.ok()) wrote = WriteChunkFiles(*writer, mine, save_options);
  STRATA_RETURN_IF_ERROR(internal::AgreeAcrossRanks(comm, wrote, "writing the checkpoint's files"));
  // Every rank's digests, for the manifest the first rank writes.
  std::vector<uint64_t> words;
  for (const internal::FileDigest& d : mine) words.insert(words.end(), {d.bytes, d.xxh3});
  std::vector<uint64_t> gathered(words.size() * size_t(ranks()));
  STRATA_RETURN_IF_ERROR(
      comm.AllGatherNow(words, gathered).WithContext("gathering the ranks' file digests"));
  Status committed;
  if (rank() == 0) {
    std::vector<internal::FileDigest> digests(gathered.size() / 2);
    for (size_t k = 0; k < digests.size(); ++k) digests[k] = {gathered[2 * k], gathered[2 * k + 1]};
    // The other ranks' files must be where this rank commits: a rank that joined a directory
    // of the same name on a file system this one does not see wrote elsewhere.
    std::vector<std::pair<std::string, uint64_t>> theirs;
    for (int r = 1; r < ranks(); ++r) {
      for (size_t i = 0; i < chunks_.size(); ++i) {
        if (chunks_[i].frozen() && FrozenChunkSaver(i) != r) continue;  // Not rank r's file.
        theirs.emplace_back(
            chunks_[i].frozen() ? ChunkFileName(i) : internal::ChunkShardFileName(i, r, ranks()),
            digests[size_t(r) * chunks_.size() + i].bytes);
      }
    }
    committed = writer->CheckFilesPresent(theirs);
    // The previous checkpoint goes after the ranks agree: removing a large one must not hold
    // them in the agreement until their collective timeout.
    if (committed.ok()) {
      committed = writer->Commit(CheckpointManifest(digests), /*keep_previous=*/true);
    }
  }
  STRATA_RETURN_IF_ERROR(internal::AgreeAcrossRanks(comm, committed, "committing the checkpoint"));
  if (rank() == 0) writer->RemovePrevious();
  return Status();
}

LossScalerState Engine::Impl::ScalerAfterLoad(const internal::EngineManifest& saved) const {
  // The saved scale is this engine's to continue only when both scale fp16 losses dynamically.
  // Otherwise this engine's configuration sets it (a static scale, or none: a bf16 checkpoint's
  // scale of 1 would leave fp16 gradients to underflow); the iteration count carries over.
  LossScalerState scaler = LossScaler(options_.precision).state();
  const bool both_dynamic_fp16 = saved.working_dtype == DType::kFp16 &&
                                 working_dtype() == DType::kFp16 &&
                                 options_.precision.loss_scale == 0.0;
  if (both_dynamic_fp16) return saved.scaler;
  scaler.iteration = saved.scaler.iteration;
  return scaler;
}

namespace {

/// Where a chunk's saved values go as its files are read: this rank's states of the chunk
/// (trained now: master | exp_avg | exp_avg_sq of elements [begin, end); frozen now: its values,
/// one array of the whole chunk) and, where `states` holds only a shard, the whole chunk's
/// master (for its working parameters). Elements from `used` on are padding and stay zero.
struct LoadTarget {
  std::byte* states = nullptr;
  size_t begin = 0;
  size_t end = 0;
  size_t arrays = 3;
  std::byte* master = nullptr;
  size_t used = 0;
};

/// Copies `bytes` read at byte `offset` of file `file` of `saved` where `target` wants them.
/// A trained chunk's file holds, for elements [file * S, (file + 1) * S) of the chunk (S its
/// numel over its files), master | exp_avg | exp_avg_sq; a frozen one's the values of all.
void Scatter(const internal::SavedChunk& saved, size_t file, std::span<const std::byte> bytes,
             uint64_t offset, const LoadTarget& target) {
  constexpr size_t kFloat = sizeof(float);
  const size_t per_array = saved.trained ? saved.numel / saved.files.size() : saved.numel;
  const size_t width = target.end - target.begin;
  size_t k = offset / kFloat;  // Pieces start and end at whole floats (files hold floats).
  const size_t last = k + bytes.size() / kFloat;
  const std::byte* source = bytes.data();
  while (k < last) {
    const size_t array = k / per_array;
    const size_t run = std::min(last - k, per_array - k % per_array);
    const size_t first = file * per_array + k % per_array;  // Elements [first, first + run).
    const size_t used_end = std::min(first + run, target.used);
    if (first < used_end) {
      if (array == 0 && target.master != nullptr) {
        std::memcpy(target.master + first * kFloat, source, (used_end - first) * kFloat);
      }
      const size_t lo = std::max(first, target.begin);
      const size_t hi = std::min(used_end, target.end);
      if (array < target.arrays && lo < hi) {
        std::memcpy(target.states + (array * width + lo - target.begin) * kFloat,
                    source + (lo - first) * kFloat, (hi - lo) * kFloat);
      }
    }
    source += run * kFloat;
    k += run;
  }
}

}  // namespace

Result<internal::EngineManifest> Engine::Impl::OpenVerified(
    const std::filesystem::path& dir, std::optional<internal::CheckpointReader>& reader) {
  STRATA_RETURN_IF_ERROR(pipeline_.CheckBetweenSteps("Load"));
  if (std::optional<size_t> held = residency_.FirstAcquired()) {
    return FailedPrecondition("Load while chunk " + std::to_string(*held) +
                              " is acquired; Release every chunk first (Load replaces its "
                              "parameters)");
  }
  STRATA_ASSIGN_OR_RETURN(internal::CheckpointReader opened, internal::CheckpointReader::Open(dir));
  reader.emplace(std::move(opened));
  Result<internal::EngineManifest> read =
      internal::ReadEngineManifest(reader->manifest(), layout_, options_.optimizer.type);
  if (!read.ok()) return read.status().WithContext("checkpoint " + dir.string());
  // Every file, before anything changes: a corrupted checkpoint changes nothing. (Each rank
  // reads every file of a chunk: its working parameters need the whole chunk's master.)
  for (const internal::SavedChunk& saved : read->chunks) {
    for (size_t f = 0; f < saved.files.size(); ++f) {
      STRATA_RETURN_IF_ERROR(
          reader->ReadFile(saved.names[f], saved.files[f],
                           [](std::span<const std::byte>, uint64_t) { return Status(); }));
    }
  }
  return read;
}

Status Engine::Impl::Load(const std::filesystem::path& dir) {
  std::optional<internal::CheckpointReader> reader;
  Result<internal::EngineManifest> saved = OpenVerified(dir, reader);
  if (!sharded()) {
    STRATA_RETURN_IF_ERROR(saved.status());
    return LoadVerified(*reader, *saved);
  }
  // Several ranks change their state only once every one of them has verified the checkpoint,
  // and all report the same outcome.
  Communicator& comm = *environment_.communicator;
  const std::string what = "loading checkpoint " + dir.string();
  STRATA_RETURN_IF_ERROR(internal::AgreeAcrossRanks(comm, saved.status(), what));
  return internal::AgreeAcrossRanks(comm, LoadVerified(*reader, *saved), what);
}

Status Engine::Impl::LoadVerified(const internal::CheckpointReader& reader,
                                  const internal::EngineManifest& saved) {
  // A failure to allocate reaches the ranks' agreement below like any other (`staged`).
  Result<AlignedBuffer> states_or = AlignedBuffer::Allocate(max_state_bytes());
  Result<AlignedBuffer> master_or =  // With several ranks: the whole chunk's master.
      AlignedBuffer::Allocate(sharded() ? layout_.max_chunk_numel() * sizeof(float) : 0);
  AlignedBuffer states = states_or.ok() ? std::move(*states_or) : AlignedBuffer();
  AlignedBuffer master = master_or.ok() ? std::move(*master_or) : AlignedBuffer();
  // Fills `states` (and `master`) for chunk i from its files, whatever world size saved them.
  auto read_chunk = [&](size_t i) -> Result<const float*> {
    const Chunk& c = chunks_[i];
    const internal::SavedChunk& from = saved.chunks[i];
    const bool shard_only = sharded() && !c.frozen();
    const LoadTarget target{.states = states.data(),
                            .begin = c.frozen() ? 0 : c.shard.begin,
                            .end = c.frozen() ? c.numel : c.shard.end,
                            .arrays = c.frozen() ? 1u : 3u,
                            .master = shard_only ? master.data() : nullptr,
                            .used = layout_.chunk(i).used_numel};
    std::memset(states.data(), 0, c.state_bytes());  // Padding; moments a frozen save lacks.
    if (shard_only) std::memset(master.data(), 0, c.numel * sizeof(float));
    for (size_t f = 0; f < from.files.size(); ++f) {
      STRATA_RETURN_IF_ERROR(reader.ReadFile(
          from.names[f], from.files[f], [&](std::span<const std::byte> piece, uint64_t offset) {
            Scatter(from, f, piece, offset, target);
            return Status();
          }));
    }
    return shard_only ? reinterpret_cast<const float*>(master.data()) : nullptr;
  };
  // Then what lives on NVMe goes into the shadow extents, where a failure half-way (a write
  // error, a full disk) leaves the current state untouched.
  auto stage_nvme = [&]() -> Status {
    for (size_t i = 0; i < chunks_.size(); ++i) {
      const Chunk& c = chunks_[i];
      if (c.placement.optimizer_states != Tier::kNvme && c.placement.params != Tier::kNvme) {
        continue;
      }
      STRATA_RETURN_IF_ERROR(read_chunk(i).status());
      STRATA_RETURN_IF_ERROR(WriteNvmeHome(i, states.data(), /*shadow=*/true)
                                 .WithContext("loading chunk " + std::to_string(i)));
    }
    return Status();
  };
  Status staged = !states_or.ok()   ? states_or.status()
                  : !master_or.ok() ? master_or.status()
                                    : stage_nvme();
  // Several ranks go on to change their memory only if every one of them staged its states:
  // a rank that could not must not be left with the old state while the others take the new.
  if (sharded()) {
    staged = internal::AgreeAcrossRanks(*environment_.communicator, staged,
                                        "staging the checkpoint's states on NVMe");
  }
  STRATA_RETURN_IF_ERROR(staged);
  // Memory tiers are written in place, once fetches (which read host-home parameters) and
  // preloads in flight are done. After the verification above only a disk that fails
  // between two reads of the same checkpoint can stop this half-way; the engine then says so.
  STRATA_RETURN_IF_ERROR(WaitForQuietMemory());
  for (size_t i = 0; i < chunks_.size(); ++i) {
    Result<const float*> whole_master = read_chunk(i);
    Status loaded = whole_master.status();
    if (loaded.ok()) loaded = WriteMemoryHome(i, states.data(), *whole_master);
    if (!loaded.ok()) {
      return loaded.WithContext("loading chunk " + std::to_string(i) +
                                " into memory after every file was verified; the engine's "
                                "host and device state is now partly loaded: load again");
    }
  }
  // Everything is in: switch to it.
  std::vector<size_t> all(chunks_.size());
  std::iota(all.begin(), all.end(), size_t(0));
  STRATA_RETURN_IF_ERROR(SwitchToNewState(all));
  pipeline_.Restore(ScalerAfterLoad(saved), saved.step_count, saved.chunk_steps);
  return Status();
}

}  // namespace strata::offload
