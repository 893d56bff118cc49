// ChunkLayout: how registered parameters are packed into chunks.
//
// A chunk is the unit of everything in the engine (moves, I/O, optimizer steps, checkpoints): a
// flat, contiguous group of whole parameters, like FSDP's FlatParameter. Parameters are packed
// in registration order, so the chunks of a model follow its layers and the order in which
// forward uses them. A chunk is closed when the next parameter would take its working
// parameters past the target size, or when the next parameter is frozen and the chunk's are not
// (or the other way round); a parameter larger than the target gets a chunk of its own
// (parameters are never split).
//
// Every parameter starts at a multiple of kParameterAlignment elements and every chunk's length
// is a multiple of kChunkAlignment elements, so each state array of a chunk (fp32 or 16-bit) is a
// whole number of 4 KiB pages: chunks can go to O_DIRECT files and DMA without copies, and the
// padding is zero and stays zero through every optimizer step.
//
// Across N data-parallel ranks (ZeRO), every chunk is padded to a multiple of N *
// kChunkAlignment elements and cut into N equal shards: rank r owns elements
// [r * S, (r + 1) * S) of every chunk, S = numel / N, and keeps optimizer states for its shards
// only. Each shard keeps the alignment of a whole chunk. A parameter may straddle shards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata::offload {

/// Elements between the starts of two parameters in a chunk: 64 (one cache line of fp32 at
/// least, so no two parameters share a line).
inline constexpr size_t kParameterAlignment = 64;
/// Chunk lengths are multiples of this many elements: 1024 fp32 = 4 KiB.
inline constexpr size_t kChunkAlignment = 1024;

/// Bytes of a chunk's optimizer states for `numel` elements: fp32 master, exp_avg and
/// exp_avg_sq, one after the other (the same layout in every tier and in checkpoints).
size_t ChunkStateBytes(size_t numel);

/// Device memory a resident chunk of `numel` working elements takes: its parameters and its
/// gradients, each rounded up to whole 4 KiB pages as devices allocate them.
size_t ChunkDeviceBytes(size_t numel, DType working_dtype);

/// A parameter as the trainer registers it.
struct ParameterSpec {
  /// Unique, non-empty name (e.g. "blocks.3.fc1.weight"); checkpoints match parameters by it.
  std::string name;
  /// Dimensions, each >= 1; the parameter has their product elements.
  std::vector<int64_t> shape;
  /// Initial values in fp32, row-major, one per element; empty = zeros. Only read by
  /// Engine::Create, which copies them.
  std::span<const float> initial_values;
  /// Its parameter group (torch.optim's param_groups; DeepSpeed takes them from the model):
  /// the weight decay of this parameter, unset = the optimizer's. 0 for biases and norms, as
  /// LLM recipes do. >= 0.
  std::optional<double> weight_decay;
  /// Its learning rate is the engine's (SetLearningRate, the schedule) times this: a group's lr
  /// relative to the base. > 0.
  double lr_scale = 1.0;
  /// Frozen (torch's requires_grad=False: an embedding or a backbone kept fixed while
  /// fine-tuning): no gradients, no optimizer states, never updated. Frozen and trained
  /// parameters never share a chunk, so a frozen chunk holds only its working parameters.
  bool frozen = false;

  /// Product of the dimensions.
  size_t numel() const;
};

/// Where one parameter lives.
struct ParameterLocation {
  size_t chunk = 0;   ///< Index of its chunk.
  size_t offset = 0;  ///< First element within the chunk.
  size_t numel = 0;   ///< Number of elements.
};

/// One chunk: `numel` elements (a multiple of kChunkAlignment), the parameters
/// [first_parameter, first_parameter + parameter_count) of the registration order.
struct ChunkInfo {
  size_t numel = 0;
  size_t used_numel = 0;  ///< Elements up to the end of its last parameter (the rest is padding).
  size_t first_parameter = 0;
  size_t parameter_count = 0;
  bool frozen = false;  ///< Its parameters are frozen (ParameterSpec::frozen), all or none.
};

/// One rank's part of a chunk: elements [begin, end).
struct ChunkShard {
  size_t begin = 0;
  size_t end = 0;
  size_t numel() const { return end - begin; }
};

/// A run of a chunk's elements [begin, end) whose parameters share their group settings, so
/// one optimizer call updates them all (padding goes with the parameter before it).
struct ChunkSegment {
  size_t begin = 0;
  size_t end = 0;
  std::optional<double> weight_decay;  ///< Unset = the optimizer's.
  double lr_scale = 1.0;
};

/// The packing of a model into chunks. Immutable after Build; safe to share across threads.
class ChunkLayout {
 public:
  /// Packs `parameters` with chunks of at most `chunk_bytes` of working parameters of
  /// `working_dtype` (except a lone larger parameter). InvalidArgument for no parameters, an
  /// empty or duplicate name, a dimension < 1, initial values of the wrong length, or a chunk
  /// size smaller than 4 KiB; each message names the parameter. `world_size` (>= 1): the
  /// data-parallel ranks each chunk is sharded across (padding every chunk to a multiple of
  /// world_size * kChunkAlignment elements; 1 = not sharded).
  static Result<ChunkLayout> Build(std::span<const ParameterSpec> parameters, DType working_dtype,
                                   uint64_t chunk_bytes, int world_size = 1);

  size_t chunk_count() const { return chunks_.size(); }
  size_t parameter_count() const { return locations_.size(); }
  const ChunkInfo& chunk(size_t index) const { return chunks_[index]; }
  const std::vector<ChunkInfo>& chunks() const { return chunks_; }
  const ParameterLocation& location(size_t parameter) const { return locations_[parameter]; }
  const std::string& name(size_t parameter) const { return names_[parameter]; }
  const std::vector<int64_t>& shape(size_t parameter) const { return shapes_[parameter]; }
  /// The chunk's elements in runs of equal group settings, covering [0, numel) in order: one
  /// run unless its parameters were registered with different settings.
  const std::vector<ChunkSegment>& segments(size_t chunk) const { return segments_[chunk]; }
  /// Ranks each chunk is sharded across (1 = not sharded).
  int world_size() const { return world_size_; }
  /// Rank `rank`'s shard of chunk `chunk` (the whole chunk with one rank).
  ChunkShard shard(size_t chunk, int rank) const;
  /// segments(chunk) cut to rank `rank`'s shard, with offsets from the shard's first element:
  /// the optimizer calls that update the shard's own state arrays.
  std::vector<ChunkSegment> ShardSegments(size_t chunk, int rank) const;
  /// Largest chunk, in elements.
  size_t max_chunk_numel() const { return max_chunk_numel_; }
  /// Sum of all chunks' elements (with padding).
  size_t total_numel() const { return total_numel_; }
  /// Sum of all parameters' elements (without padding).
  size_t parameter_numel() const { return parameter_numel_; }

 private:
  std::vector<ChunkInfo> chunks_;
  std::vector<ParameterLocation> locations_;
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<std::vector<ChunkSegment>> segments_;
  size_t max_chunk_numel_ = 0;
  size_t total_numel_ = 0;
  size_t parameter_numel_ = 0;
  int world_size_ = 1;
};

}  // namespace strata::offload
