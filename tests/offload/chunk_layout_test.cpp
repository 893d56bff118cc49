// Tests for strata/offload/chunk_layout.h.

#include "strata/offload/chunk_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata::offload {
namespace {

ParameterSpec Param(std::string name, std::vector<int64_t> shape) {
  ParameterSpec spec;
  spec.name = std::move(name);
  spec.shape = std::move(shape);
  return spec;
}

/// Builds a layout that must succeed.
ChunkLayout MustBuild(const std::vector<ParameterSpec>& parameters, DType dtype,
                      uint64_t chunk_bytes) {
  Result<ChunkLayout> layout = ChunkLayout::Build(parameters, dtype, chunk_bytes);
  EXPECT_TRUE(layout.ok()) << layout.status().ToString();
  return layout.ok() ? std::move(layout).value() : ChunkLayout();
}

/// Builds a layout that must fail with InvalidArgument; returns the message.
std::string BuildError(const std::vector<ParameterSpec>& parameters,
                       uint64_t chunk_bytes = 64 * kKiB, DType dtype = DType::kFp32) {
  Result<ChunkLayout> layout = ChunkLayout::Build(parameters, dtype, chunk_bytes);
  EXPECT_FALSE(layout.ok());
  if (layout.ok()) return "";
  EXPECT_EQ(layout.status().code(), StatusCode::kInvalidArgument) << layout.status().ToString();
  return layout.status().message();
}

/// The invariants every layout keeps, whatever the parameters.
void ExpectAligned(const ChunkLayout& layout) {
  for (size_t c = 0; c < layout.chunk_count(); ++c) {
    const ChunkInfo& chunk = layout.chunk(c);
    EXPECT_GT(chunk.numel, 0u) << "chunk " << c;
    EXPECT_EQ(chunk.numel % kChunkAlignment, 0u) << "chunk " << c;
    EXPECT_LE(chunk.used_numel, chunk.numel) << "chunk " << c;
    EXPECT_GT(chunk.parameter_count, 0u) << "chunk " << c;
  }
  for (size_t p = 0; p < layout.parameter_count(); ++p) {
    EXPECT_EQ(layout.location(p).offset % kParameterAlignment, 0u) << layout.name(p);
  }
}

TEST(ChunkLayoutTest, Constants) {
  EXPECT_EQ(kParameterAlignment, 64u);
  EXPECT_EQ(kChunkAlignment, 1024u);
}

TEST(ChunkLayoutTest, ParameterNumelIsTheProductOfDimensions) {
  EXPECT_EQ(Param("a", {7}).numel(), 7u);
  EXPECT_EQ(Param("b", {2, 3, 4}).numel(), 24u);
  EXPECT_EQ(Param("c", {4096, 4096}).numel(), 16777216u);
  EXPECT_EQ(Param("d", {1, 1, 1}).numel(), 1u);
}

TEST(ChunkLayoutTest, PacksInRegistrationOrderAtAlignedOffsets) {
  const std::vector<ParameterSpec> params = {
      Param("embed", {10}),
      Param("fc.weight", {3, 5}),
      Param("fc.bias", {100}),
      Param("norm", {64}),
  };
  const ChunkLayout layout = MustBuild(params, DType::kFp32, 16 * kKiB);  // 4096 fp32.

  ASSERT_EQ(layout.chunk_count(), 1u);
  ASSERT_EQ(layout.parameter_count(), 4u);

  EXPECT_EQ(layout.name(0), "embed");
  EXPECT_EQ(layout.name(1), "fc.weight");
  EXPECT_EQ(layout.name(2), "fc.bias");
  EXPECT_EQ(layout.name(3), "norm");
  EXPECT_EQ(layout.shape(0), (std::vector<int64_t>{10}));
  EXPECT_EQ(layout.shape(1), (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(layout.shape(2), (std::vector<int64_t>{100}));
  EXPECT_EQ(layout.shape(3), (std::vector<int64_t>{64}));

  // 10 -> next start 64; 64 + 15 = 79 -> 128; 128 + 100 = 228 -> 256; 256 + 64 = 320.
  const size_t want_offsets[] = {0, 64, 128, 256};
  const size_t want_numel[] = {10, 15, 100, 64};
  for (size_t p = 0; p < 4; ++p) {
    EXPECT_EQ(layout.location(p).chunk, 0u) << layout.name(p);
    EXPECT_EQ(layout.location(p).offset, want_offsets[p]) << layout.name(p);
    EXPECT_EQ(layout.location(p).numel, want_numel[p]) << layout.name(p);
  }

  const ChunkInfo& chunk = layout.chunk(0);
  EXPECT_EQ(chunk.used_numel, 320u);
  EXPECT_EQ(chunk.numel, 1024u);
  EXPECT_EQ(chunk.first_parameter, 0u);
  EXPECT_EQ(chunk.parameter_count, 4u);
  EXPECT_EQ(layout.chunks().size(), 1u);
  EXPECT_EQ(layout.max_chunk_numel(), 1024u);
  EXPECT_EQ(layout.total_numel(), 1024u);
  EXPECT_EQ(layout.parameter_numel(), 189u);
  ExpectAligned(layout);
}

TEST(ChunkLayoutTest, AlignedParameterNeedsNoPadding) {
  const ChunkLayout layout =
      MustBuild({Param("a", {128}), Param("b", {64}), Param("c", {1})}, DType::kFp32, 4 * kKiB);
  ASSERT_EQ(layout.chunk_count(), 1u);
  EXPECT_EQ(layout.location(0).offset, 0u);
  EXPECT_EQ(layout.location(1).offset, 128u);
  EXPECT_EQ(layout.location(2).offset, 192u);
  EXPECT_EQ(layout.chunk(0).used_numel, 193u);
}

TEST(ChunkLayoutTest, ChunkClosesWhenTheNextParameterWouldExceedTheTarget) {
  // 4 KiB of fp32 = 1024 elements. "b" would start at 640 and end at 1040 > 1024.
  const ChunkLayout layout =
      MustBuild({Param("a", {600}), Param("b", {400}), Param("c", {20})}, DType::kFp32, 4 * kKiB);
  ASSERT_EQ(layout.chunk_count(), 2u);

  EXPECT_EQ(layout.location(0).chunk, 0u);
  EXPECT_EQ(layout.location(0).offset, 0u);
  EXPECT_EQ(layout.location(1).chunk, 1u);
  EXPECT_EQ(layout.location(1).offset, 0u);
  EXPECT_EQ(layout.location(2).chunk, 1u);
  EXPECT_EQ(layout.location(2).offset, 448u);

  EXPECT_EQ(layout.chunk(0).numel, 1024u);
  EXPECT_EQ(layout.chunk(0).used_numel, 600u);
  EXPECT_EQ(layout.chunk(0).first_parameter, 0u);
  EXPECT_EQ(layout.chunk(0).parameter_count, 1u);
  EXPECT_EQ(layout.chunk(1).numel, 1024u);
  EXPECT_EQ(layout.chunk(1).used_numel, 468u);
  EXPECT_EQ(layout.chunk(1).first_parameter, 1u);
  EXPECT_EQ(layout.chunk(1).parameter_count, 2u);

  EXPECT_EQ(layout.max_chunk_numel(), 1024u);
  EXPECT_EQ(layout.total_numel(), 2048u);
  EXPECT_EQ(layout.parameter_numel(), 1020u);
  ExpectAligned(layout);
}

TEST(ChunkLayoutTest, FrozenAndTrainedParametersNeverShareAChunk) {
  std::vector<ParameterSpec> params = {Param("embed", {100}), Param("a", {100}), Param("b", {100}),
                                       Param("head", {100}), Param("bias", {100})};
  params[0].frozen = true;  // A frozen embedding, a trained block, a frozen head.
  params[3].frozen = true;
  params[4].frozen = true;
  const ChunkLayout layout = MustBuild(params, DType::kFp32, 64 * kKiB);  // Room for all.
  ExpectAligned(layout);
  ASSERT_EQ(layout.chunk_count(), 3u);
  EXPECT_TRUE(layout.chunk(0).frozen);
  EXPECT_FALSE(layout.chunk(1).frozen);
  EXPECT_TRUE(layout.chunk(2).frozen);
  EXPECT_EQ(layout.chunk(1).first_parameter, 1u);
  EXPECT_EQ(layout.chunk(1).parameter_count, 2u);
  EXPECT_EQ(layout.chunk(2).parameter_count, 2u);  // Frozen neighbours still pack together.
  EXPECT_EQ(layout.location(3).chunk, 2u);
  EXPECT_EQ(layout.location(3).offset, 0u);
}

TEST(ChunkLayoutTest, ParameterEndingExactlyAtTheTargetStaysInTheChunk) {
  // "b" starts at 640 and ends at 640 + 384 = 1024: it fits exactly.
  const ChunkLayout layout =
      MustBuild({Param("a", {600}), Param("b", {384}), Param("c", {1})}, DType::kFp32, 4 * kKiB);
  ASSERT_EQ(layout.chunk_count(), 2u);
  EXPECT_EQ(layout.location(1).chunk, 0u);
  EXPECT_EQ(layout.location(1).offset, 640u);
  EXPECT_EQ(layout.chunk(0).used_numel, 1024u);
  EXPECT_EQ(layout.chunk(0).numel, 1024u);
  EXPECT_EQ(layout.chunk(0).parameter_count, 2u);
  EXPECT_EQ(layout.location(2).chunk, 1u);
  EXPECT_EQ(layout.location(2).offset, 0u);
  EXPECT_EQ(layout.chunk(1).first_parameter, 2u);
  EXPECT_EQ(layout.chunk(1).parameter_count, 1u);
}

TEST(ChunkLayoutTest, AlignmentPaddingCountsAgainstTheTarget) {
  // 1000 + 24 = 1024 elements of data, but "b" starts at AlignUp(1000, 64) = 1024.
  const ChunkLayout layout =
      MustBuild({Param("a", {1000}), Param("b", {24})}, DType::kFp32, 4 * kKiB);
  ASSERT_EQ(layout.chunk_count(), 2u);
  EXPECT_EQ(layout.location(1).chunk, 1u);
  EXPECT_EQ(layout.location(1).offset, 0u);
}

TEST(ChunkLayoutTest, TwoByteDtypesPackTwiceTheElementsOfFp32) {
  const std::vector<ParameterSpec> params = {Param("p0", {512}), Param("p1", {16, 32}),
                                             Param("p2", {512}), Param("p3", {2, 256})};

  // fp32: 4 KiB = 1024 elements, two parameters per chunk.
  const ChunkLayout fp32 = MustBuild(params, DType::kFp32, 4 * kKiB);
  ASSERT_EQ(fp32.chunk_count(), 2u);
  const size_t want_fp32_chunk[] = {0, 0, 1, 1};
  const size_t want_fp32_offset[] = {0, 512, 0, 512};
  for (size_t p = 0; p < 4; ++p) {
    EXPECT_EQ(fp32.location(p).chunk, want_fp32_chunk[p]) << p;
    EXPECT_EQ(fp32.location(p).offset, want_fp32_offset[p]) << p;
  }
  EXPECT_EQ(fp32.chunk(0).numel, 1024u);
  EXPECT_EQ(fp32.chunk(1).numel, 1024u);
  EXPECT_EQ(fp32.chunk(1).first_parameter, 2u);
  EXPECT_EQ(fp32.max_chunk_numel(), 1024u);
  EXPECT_EQ(fp32.total_numel(), 2048u);
  EXPECT_EQ(fp32.parameter_numel(), 2048u);

  // bf16 and fp16: the same 4 KiB is 2048 elements, all four parameters in one chunk.
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    const ChunkLayout half = MustBuild(params, dtype, 4 * kKiB);
    ASSERT_EQ(half.chunk_count(), 1u);
    for (size_t p = 0; p < 4; ++p) {
      EXPECT_EQ(half.location(p).chunk, 0u) << p;
      EXPECT_EQ(half.location(p).offset, 512 * p) << p;
    }
    EXPECT_EQ(half.chunk(0).numel, 2048u);
    EXPECT_EQ(half.chunk(0).used_numel, 2048u);
    EXPECT_EQ(half.chunk(0).parameter_count, 4u);
    EXPECT_EQ(half.max_chunk_numel(), 2048u);
    EXPECT_EQ(half.total_numel(), 2048u);
    EXPECT_EQ(half.parameter_numel(), 2048u);
  }
}

TEST(ChunkLayoutTest, DefaultChunkBytesHoldOneOrTwoSquareMatrices) {
  // 64 MiB of fp32 is one 4096 x 4096 matrix; of bf16, two.
  const std::vector<ParameterSpec> params = {Param("w0", {4096, 4096}), Param("w1", {4096, 4096}),
                                             Param("w2", {4096, 4096}), Param("w3", {4096, 4096})};
  const ChunkLayout fp32 = MustBuild(params, DType::kFp32, 64 * kMiB);
  ASSERT_EQ(fp32.chunk_count(), 4u);
  for (size_t c = 0; c < 4; ++c) {
    EXPECT_EQ(fp32.chunk(c).numel, 16777216u);
    EXPECT_EQ(fp32.chunk(c).parameter_count, 1u);
    EXPECT_EQ(fp32.chunk(c).first_parameter, c);
  }
  const ChunkLayout bf16 = MustBuild(params, DType::kBf16, 64 * kMiB);
  ASSERT_EQ(bf16.chunk_count(), 2u);
  EXPECT_EQ(bf16.location(1).chunk, 0u);
  EXPECT_EQ(bf16.location(1).offset, 16777216u);
  EXPECT_EQ(bf16.location(2).chunk, 1u);
  EXPECT_EQ(bf16.location(2).offset, 0u);
  EXPECT_EQ(bf16.chunk(0).numel, 33554432u);
  EXPECT_EQ(bf16.max_chunk_numel(), 33554432u);
  EXPECT_EQ(bf16.total_numel(), 67108864u);
  EXPECT_EQ(bf16.parameter_numel(), 67108864u);
}

TEST(ChunkLayoutTest, OversizedParameterGetsAChunkOfItsOwn) {
  // Target 1024 fp32 elements; "big" has 3000.
  const ChunkLayout layout =
      MustBuild({Param("small0", {100}), Param("big", {3, 1000}), Param("small1", {100})},
                DType::kFp32, 4 * kKiB);
  ASSERT_EQ(layout.chunk_count(), 3u);

  EXPECT_EQ(layout.location(0).chunk, 0u);
  EXPECT_EQ(layout.location(1).chunk, 1u);
  EXPECT_EQ(layout.location(1).offset, 0u);
  EXPECT_EQ(layout.location(1).numel, 3000u);
  EXPECT_EQ(layout.location(2).chunk, 2u);
  EXPECT_EQ(layout.location(2).offset, 0u);

  EXPECT_EQ(layout.chunk(0).numel, 1024u);
  EXPECT_EQ(layout.chunk(1).numel, 3072u);
  EXPECT_EQ(layout.chunk(1).used_numel, 3000u);
  EXPECT_EQ(layout.chunk(1).first_parameter, 1u);
  EXPECT_EQ(layout.chunk(1).parameter_count, 1u);
  EXPECT_EQ(layout.chunk(2).numel, 1024u);
  EXPECT_EQ(layout.chunk(2).first_parameter, 2u);

  EXPECT_EQ(layout.max_chunk_numel(), 3072u);
  EXPECT_EQ(layout.total_numel(), 5120u);
  EXPECT_EQ(layout.parameter_numel(), 3200u);
  ExpectAligned(layout);
}

TEST(ChunkLayoutTest, OversizedFirstAndOnlyParameter) {
  const ChunkLayout layout = MustBuild({Param("huge", {5000})}, DType::kBf16, 4 * kKiB);
  ASSERT_EQ(layout.chunk_count(), 1u);
  EXPECT_EQ(layout.location(0).chunk, 0u);
  EXPECT_EQ(layout.location(0).offset, 0u);
  EXPECT_EQ(layout.chunk(0).used_numel, 5000u);
  EXPECT_EQ(layout.chunk(0).numel, 5120u);
  EXPECT_EQ(layout.max_chunk_numel(), 5120u);
  EXPECT_EQ(layout.total_numel(), 5120u);
  EXPECT_EQ(layout.parameter_numel(), 5000u);
}

TEST(ChunkLayoutTest, ConsecutiveOversizedParametersEachGetAChunk) {
  const ChunkLayout layout =
      MustBuild({Param("a", {2048}), Param("b", {1025}), Param("c", {1})}, DType::kFp32, 4 * kKiB);
  ASSERT_EQ(layout.chunk_count(), 3u);
  EXPECT_EQ(layout.chunk(0).numel, 2048u);
  EXPECT_EQ(layout.chunk(1).numel, 2048u);
  EXPECT_EQ(layout.chunk(2).numel, 1024u);
  EXPECT_EQ(layout.max_chunk_numel(), 2048u);
  EXPECT_EQ(layout.total_numel(), 5120u);
  EXPECT_EQ(layout.parameter_numel(), 3074u);
}

TEST(ChunkLayoutTest, SmallestChunkBytesIsAccepted) {
  const ChunkLayout layout = MustBuild({Param("a", {1})}, DType::kFp32, 4096);
  ASSERT_EQ(layout.chunk_count(), 1u);
  EXPECT_EQ(layout.chunk(0).numel, kChunkAlignment);
  EXPECT_EQ(layout.chunk(0).used_numel, 1u);
}

TEST(ChunkLayoutTest, ChunkBytesThatAreNotAMultipleOfTheDtypeSizeRoundDown) {
  // 4097 bytes of fp32 hold 1024 elements, not 1025.
  const ChunkLayout layout = MustBuild({Param("a", {1024}), Param("b", {1})}, DType::kFp32, 4097);
  EXPECT_EQ(layout.chunk_count(), 2u);
}

TEST(ChunkLayoutTest, AcceptsInitialValuesOfTheRightLength) {
  const std::vector<float> values(6, 0.5f);
  std::vector<ParameterSpec> params = {Param("w", {2, 3}), Param("b", {3})};
  params[0].initial_values = values;
  const ChunkLayout layout = MustBuild(params, DType::kFp32, 4 * kKiB);
  EXPECT_EQ(layout.parameter_count(), 2u);
  EXPECT_EQ(layout.parameter_numel(), 9u);
}

TEST(ChunkLayoutTest, RandomModelsKeepTheInvariants) {
  constexpr DType kDTypes[] = {DType::kFp32, DType::kBf16, DType::kFp16};
  std::mt19937 rng(20240611);
  for (int trial = 0; trial < 200; ++trial) {
    const DType dtype = kDTypes[trial % 3];
    // Whole pages, and half of the time a few bytes more, which round down.
    uint64_t chunk_bytes = 4096 * (1 + rng() % 8);
    if (rng() % 2 == 1) chunk_bytes += rng() % 4096;
    const size_t target = chunk_bytes / DTypeSize(dtype);
    std::vector<ParameterSpec> params;
    const int count = 1 + static_cast<int>(rng() % 40);
    size_t want_parameter_numel = 0;
    for (int i = 0; i < count; ++i) {
      std::vector<int64_t> shape(1 + rng() % 3);
      for (int64_t& d : shape) d = 1 + static_cast<int64_t>(rng() % 70);
      params.push_back(Param("p" + std::to_string(i), std::move(shape)));
      want_parameter_numel += params.back().numel();
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    const ChunkLayout layout = MustBuild(params, dtype, chunk_bytes);
    ASSERT_EQ(layout.parameter_count(), params.size());
    ExpectAligned(layout);

    size_t total = 0;
    size_t max_numel = 0;
    size_t next_parameter = 0;
    for (size_t c = 0; c < layout.chunk_count(); ++c) {
      const ChunkInfo& chunk = layout.chunk(c);
      // Chunks cover the parameters in order, without gaps.
      EXPECT_EQ(chunk.first_parameter, next_parameter);
      next_parameter += chunk.parameter_count;
      total += chunk.numel;
      max_numel = std::max(max_numel, chunk.numel);
      // Only a lone parameter may exceed the target.
      if (chunk.parameter_count > 1) {
        EXPECT_LE(chunk.used_numel, target);
      }
      EXPECT_EQ(chunk.numel, AlignUp(chunk.used_numel, kChunkAlignment));
      // The chunk closed because its successor's first parameter did not fit.
      if (c + 1 < layout.chunk_count()) {
        const size_t next = layout.chunk(c + 1).first_parameter;
        EXPECT_GT(AlignUp(chunk.used_numel, kParameterAlignment) + params[next].numel(), target);
      }
      // Parameters follow one another at the first aligned offset after their predecessor.
      size_t end = 0;
      for (size_t p = chunk.first_parameter; p < chunk.first_parameter + chunk.parameter_count;
           ++p) {
        const ParameterLocation& loc = layout.location(p);
        EXPECT_EQ(loc.chunk, c);
        EXPECT_EQ(loc.offset, AlignUp(end, kParameterAlignment));
        EXPECT_EQ(loc.numel, params[p].numel());
        EXPECT_EQ(layout.name(p), params[p].name);
        EXPECT_EQ(layout.shape(p), params[p].shape);
        end = loc.offset + loc.numel;
      }
      EXPECT_EQ(chunk.used_numel, end);
    }
    EXPECT_EQ(next_parameter, params.size());
    EXPECT_EQ(layout.total_numel(), total);
    EXPECT_EQ(layout.max_chunk_numel(), max_numel);
    EXPECT_EQ(layout.parameter_numel(), want_parameter_numel);
  }
}

// Across N ranks every chunk is padded to N aligned shards that cover it without overlap, and
// each rank's segments cover its shard with the group settings of the elements they hold. One
// rank is the unsharded layout.
TEST(ChunkLayoutTest, ShardsSplitEveryChunkEvenlyAcrossTheRanks) {
  std::mt19937 rng(20261202);
  std::vector<ParameterSpec> params;
  for (int i = 0; i < 30; ++i) {
    params.push_back(Param("p" + std::to_string(i), {1 + int64_t(rng() % 3000)}));
    if (i % 4 == 1) params.back().weight_decay = 0.0;  // Biases and norms: their own group.
    if (i % 7 == 3) params.back().lr_scale = 0.5;
  }
  const ChunkLayout one = MustBuild(params, DType::kBf16, 16 * kKiB);
  for (int world : {1, 2, 3, 8}) {
    SCOPED_TRACE("world size " + std::to_string(world));
    auto built = ChunkLayout::Build(params, DType::kBf16, 16 * kKiB, world);
    ASSERT_TRUE(built.ok()) << built.status().ToString();
    const ChunkLayout& layout = *built;
    EXPECT_EQ(layout.world_size(), world);
    ASSERT_EQ(layout.chunk_count(), one.chunk_count());  // Same packing, more padding.
    for (size_t c = 0; c < layout.chunk_count(); ++c) {
      const ChunkInfo& chunk = layout.chunk(c);
      EXPECT_EQ(chunk.used_numel, one.chunk(c).used_numel);
      const size_t unit = kChunkAlignment * world;  // Not a power of two for 3 ranks.
      EXPECT_EQ(chunk.numel, (chunk.used_numel + unit - 1) / unit * unit);
      size_t next = 0;
      for (int r = 0; r < world; ++r) {
        const ChunkShard shard = layout.shard(c, r);
        EXPECT_EQ(shard.begin, next);
        EXPECT_EQ(shard.numel(), chunk.numel / world);
        EXPECT_EQ(shard.numel() % kChunkAlignment, 0u);
        next = shard.end;
        // The rank's segments tile its shard, each with the settings of its elements.
        size_t covered = 0;
        for (const ChunkSegment& piece : layout.ShardSegments(c, r)) {
          EXPECT_EQ(piece.begin, covered);
          EXPECT_LT(piece.begin, piece.end);
          covered = piece.end;
          const size_t first = shard.begin + piece.begin, last = shard.begin + piece.end - 1;
          for (size_t element : {first, last}) {
            const auto& whole = layout.segments(c);
            auto it = std::find_if(whole.begin(), whole.end(), [&](const ChunkSegment& w) {
              return w.begin <= element && element < w.end;
            });
            ASSERT_NE(it, whole.end());
            EXPECT_EQ(it->weight_decay, piece.weight_decay);
            EXPECT_EQ(it->lr_scale, piece.lr_scale);
          }
        }
        EXPECT_EQ(covered, shard.numel());
      }
      EXPECT_EQ(next, chunk.numel);
    }
    if (world == 1) {
      EXPECT_EQ(layout.total_numel(), one.total_numel());
    }
  }
  EXPECT_EQ(ChunkLayout::Build(params, DType::kBf16, 16 * kKiB, 0).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(ChunkLayoutTest, RejectsNoParameters) {
  EXPECT_EQ(BuildError({}), "no parameters registered");
}

TEST(ChunkLayoutTest, RejectsChunkBytesBelow4KiB) {
  EXPECT_EQ(BuildError({Param("a", {1})}, 4095), "chunk_bytes 4095 is below the minimum of 4096");
  EXPECT_EQ(BuildError({Param("a", {1})}, 0), "chunk_bytes 0 is below the minimum of 4096");
}

TEST(ChunkLayoutTest, RejectsEmptyName) {
  EXPECT_EQ(BuildError({Param("a", {1}), Param("", {4})}), "a parameter has an empty name");
}

TEST(ChunkLayoutTest, RejectsDuplicateName) {
  EXPECT_EQ(
      BuildError({Param("blocks.0.w", {4}), Param("blocks.1.w", {4}), Param("blocks.0.w", {8})}),
      "parameter name 'blocks.0.w' is registered twice");
}

TEST(ChunkLayoutTest, RejectsDimensionBelowOne) {
  EXPECT_EQ(BuildError({Param("ok", {3}), Param("fc.weight", {4, 0})}),
            "parameter 'fc.weight' has dimension 0; every dimension must be >= 1");
  EXPECT_EQ(BuildError({Param("fc.bias", {-3})}),
            "parameter 'fc.bias' has dimension -3; every dimension must be >= 1");
}

TEST(ChunkLayoutTest, RejectsEmptyShape) {
  EXPECT_EQ(BuildError({Param("scalar", {})}), "parameter 'scalar' has no dimensions");
}

TEST(ChunkLayoutTest, RejectsInitialValuesOfTheWrongLength) {
  const std::vector<float> five(5, 1.0f);
  std::vector<ParameterSpec> params = {Param("w", {2, 3})};
  params[0].initial_values = five;
  EXPECT_EQ(BuildError(params), "parameter 'w' has 6 elements but 5 initial values");

  const std::vector<float> seven(7, 1.0f);
  params[0].initial_values = seven;
  EXPECT_EQ(BuildError(params), "parameter 'w' has 6 elements but 7 initial values");
}

}  // namespace
}  // namespace strata::offload
