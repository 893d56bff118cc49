#include "strata/offload/chunk_layout.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "strata/core/aligned_buffer.h"
#include "strata/core/bytes.h"

namespace strata::offload {

size_t ChunkStateBytes(size_t numel) { return numel * sizeof(float) * 3; }

size_t ChunkDeviceBytes(size_t numel, DType working_dtype) {
  return 2 * AlignUp(numel * DTypeSize(working_dtype), kHostAlignment);
}

size_t ParameterSpec::numel() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(std::max<int64_t>(d, 0));
  return n;
}

Result<ChunkLayout> ChunkLayout::Build(std::span<const ParameterSpec> parameters,
                                       DType working_dtype, uint64_t chunk_bytes, int world_size) {
  if (parameters.empty()) return InvalidArgument("no parameters registered");
  if (world_size < 1 || world_size > (1 << 24)) {
    return InvalidArgument("world size " + std::to_string(world_size) +
                           " must be in [1, 16777216]");
  }
  if (chunk_bytes < kHostAlignment) {
    return InvalidArgument("chunk_bytes " + std::to_string(chunk_bytes) +
                           " is below the minimum of 4096");
  }
  const size_t target_numel = std::max<size_t>(chunk_bytes / DTypeSize(working_dtype), 1);

  ChunkLayout layout;
  layout.world_size_ = world_size;
  std::unordered_set<std::string_view> seen;
  ChunkInfo open;                      // The chunk being filled.
  std::vector<ChunkSegment> segments;  // Of the open chunk.
  auto close = [&] {
    // N aligned shards (N need not be a power of two, which AlignUp needs).
    const size_t shards = size_t(world_size);
    const size_t unit = kChunkAlignment * shards;
    open.numel = (open.used_numel + unit - 1) / unit * unit;
    layout.max_chunk_numel_ = std::max(layout.max_chunk_numel_, open.numel);
    layout.total_numel_ += open.numel;
    layout.chunks_.push_back(open);
    segments.back().end = open.numel;
    layout.segments_.push_back(std::move(segments));
    segments.clear();
    open = ChunkInfo{.first_parameter = layout.locations_.size()};
  };

  for (const ParameterSpec& p : parameters) {
    if (p.name.empty()) return InvalidArgument("a parameter has an empty name");
    if (!seen.insert(p.name).second) {
      return InvalidArgument("parameter name '" + p.name + "' is registered twice");
    }
    if (p.shape.empty()) return InvalidArgument("parameter '" + p.name + "' has no dimensions");
    for (int64_t d : p.shape) {
      if (d < 1) {
        return InvalidArgument("parameter '" + p.name + "' has dimension " + std::to_string(d) +
                               "; every dimension must be >= 1");
      }
    }
    const size_t numel = p.numel();
    if (!p.initial_values.empty() && p.initial_values.size() != numel) {
      return InvalidArgument("parameter '" + p.name + "' has " + std::to_string(numel) +
                             " elements but " + std::to_string(p.initial_values.size()) +
                             " initial values");
    }
    if (p.weight_decay && !(*p.weight_decay >= 0.0 && std::isfinite(*p.weight_decay))) {
      return InvalidArgument("parameter '" + p.name + "' has weight decay " +
                             std::to_string(*p.weight_decay) + "; it must be finite and >= 0");
    }
    if (!(p.lr_scale > 0.0 && std::isfinite(p.lr_scale))) {
      return InvalidArgument("parameter '" + p.name + "' has learning-rate scale " +
                             std::to_string(p.lr_scale) + "; it must be finite and > 0");
    }
    size_t offset = AlignUp(open.used_numel, kParameterAlignment);
    if (open.parameter_count > 0 && (offset + numel > target_numel || open.frozen != p.frozen)) {
      close();
      offset = 0;
    }
    open.frozen = p.frozen;
    if (segments.empty() || segments.back().weight_decay != p.weight_decay ||
        segments.back().lr_scale != p.lr_scale) {
      if (!segments.empty()) segments.back().end = offset;
      segments.push_back({.begin = offset, .weight_decay = p.weight_decay, .lr_scale = p.lr_scale});
    }
    layout.locations_.push_back({layout.chunks_.size(), offset, numel});
    layout.names_.push_back(p.name);
    layout.shapes_.push_back(p.shape);
    layout.parameter_numel_ += numel;
    open.used_numel = offset + numel;
    ++open.parameter_count;
  }
  close();
  return layout;
}

ChunkShard ChunkLayout::shard(size_t chunk, int rank) const {
  const size_t size = chunks_[chunk].numel / size_t(world_size_);
  return {size * size_t(rank), size * size_t(rank + 1)};
}

std::vector<ChunkSegment> ChunkLayout::ShardSegments(size_t chunk, int rank) const {
  const ChunkShard own = shard(chunk, rank);
  std::vector<ChunkSegment> cut;
  for (const ChunkSegment& s : segments_[chunk]) {
    const size_t begin = std::max(s.begin, own.begin), end = std::min(s.end, own.end);
    if (begin >= end) continue;
    cut.push_back({.begin = begin - own.begin,
                   .end = end - own.begin,
                   .weight_decay = s.weight_decay,
                   .lr_scale = s.lr_scale});
  }
  return cut;
}

}  // namespace strata::offload
