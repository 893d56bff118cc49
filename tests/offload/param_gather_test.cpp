// ParamGather on its own (sharding/param_gather.h): ranks that are threads with local
// communicators, each with its own chunks (its shard of every chunk's working parameters), a
// HostDevice and an optimizer for quantizing; no engine. What it promises: Take returns the whole
// chunk gathered from every rank's shard, in rank order, from host or NVMe homes, quantized
// (blockwise int8) when asked, and gathers the upcoming chunks ahead into free slots; Discard
// throws prefetched gathers away; a failed collective fails the Take on every rank, and a
// failure of this rank's own part (or Fail) refuses every later Take on it.
#include "sharding/param_gather.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "communicator_conformance.h"
#include "part_support.h"
#include "strata/core/host_device.h"
#include "strata/nvme/fault_injection.h"
#include "support/scratch_dir.h"

namespace strata::offload {
namespace {

using testing::ChunkValues;
using testing::Group;
using testing::HoldsChunk;
using testing::OnEveryRank;
using testing::RegisteredMetrics;

constexpr int kRanks = 3;
constexpr size_t kShard = 1000;  // Not a multiple of the quantization block (256).
constexpr size_t kNumel = kRanks * kShard;
constexpr size_t kChunks = 3;
constexpr double kGatherBytes = kNumel * sizeof(float);  // What one fp32 gather counts.

/// One rank's ParamGather over its shards of kChunks chunks (chunk c holds ChunkValues(c) as a
/// whole), with host homes, or NVMe homes in a swap space of its own.
class Rank {
 public:
  Rank(Communicator& comm, size_t slots, EngineOptions options = {},
       const std::shared_ptr<nvme::FaultPlan>& nvme_faults = nullptr)
      : rank_(comm.rank()), options_(std::move(options)) {
    options_.precision.working_dtype = DType::kFp32;
    device_ = std::move(CreateHostDevice()).value();
    optimizer_.emplace(std::move(cpu_adam::CpuOptimizer::Create({.threads = 1})).value());
    if (nvme_faults) OpenSwap(nvme_faults);
    for (size_t c = 0; c < kChunks; ++c) {
      Chunk& chunk = chunks_[c];
      chunk.numel = kNumel;
      chunk.shard = {size_t(rank_) * kShard, size_t(rank_ + 1) * kShard};
      chunk.params_sharded = true;
      chunk.placement = {.params = swap_ ? Tier::kNvme : Tier::kHost,
                         .optimizer_states = Tier::kHost};
      SetShard(c, c);
    }
    gather_.emplace(ParamGather::Resources{.options = options_,
                                           .device = *device_,
                                           .chunks = chunks_,
                                           .ranks = kRanks,
                                           .metrics = metrics_.metrics});
    Status initialized = gather_->Initialize(slots, kNumel * sizeof(float), kShard);
    EXPECT_TRUE(initialized.ok()) << initialized.ToString();
    gather_->Connect(comm, swap_.get(), *optimizer_);
  }
  /// Nothing may still write the slots when they go.
  ~Rank() { gather_->Discard(); }

  /// Gives chunk `c`'s home this rank's shard of ChunkValues(`values`). Between gathers only.
  void SetShard(size_t c, size_t values) {
    Chunk& chunk = chunks_[c];
    AlignedBuffer shard = ChunkValues(values, kShard, chunk.shard.begin);
    if (!swap_) {
      chunk.host_params = std::move(shard);
      return;
    }
    if (!chunk.param_extents[0].valid()) {
      chunk.param_extents[0] = std::move(swap_->Allocate(kShard * sizeof(float))).value();
    }
    ASSERT_TRUE(swap_->WriteSync(chunk.param_extent(), shard.data(), kShard * sizeof(float)).ok());
  }

  ParamGather& gather() { return *gather_; }
  Chunk& chunk(size_t c) { return chunks_[c]; }
  cpu_adam::CpuOptimizer& optimizer() { return *optimizer_; }
  int rank() const { return rank_; }
  double gathered_bytes() {
    return metrics_.metrics.collective_of(CollectiveKind::kAllGather).Value();
  }
  double nvme_read_bytes() const { return metrics_.metrics.nvme_read_bytes->Value(); }

  /// Takes `chunk` (gathering `upcoming` ahead), checks it holds ChunkValues(`values`) whole,
  /// and returns it.
  void TakeAndCheck(size_t chunk, std::vector<size_t> upcoming = {}, size_t values = ~size_t{0}) {
    SCOPED_TRACE("rank " + std::to_string(rank_) + ", chunk " + std::to_string(chunk));
    Result<const std::byte*> taken = gather_->Take(chunk, upcoming);
    ASSERT_TRUE(taken.ok()) << taken.status().ToString();
    EXPECT_TRUE(HoldsChunk(*taken, values == ~size_t{0} ? chunk : values, kNumel));
    gather_->Return(chunk);
  }

 private:
  void OpenSwap(const std::shared_ptr<nvme::FaultPlan>& faults) {
    io_ = std::move(nvme::IoEngine::Create({.block_size = 64 << 10,
                                            .queue_depth = 4,
                                            .wrap_backend =
                                                [faults](auto inner) {
                                                  return nvme::CreateFaultInjectingBackend(
                                                      std::move(inner), faults);
                                                }}))
              .value();
    swap_ = std::move(
                nvme::SwapSpace::Create({.paths = {dir_.path()}, .bytes_per_path = 4 << 20}, *io_))
                .value();
  }

  const int rank_;
  EngineOptions options_;
  RegisteredMetrics metrics_;
  std::unique_ptr<Device> device_;
  std::optional<cpu_adam::CpuOptimizer> optimizer_;
  strata::testing::ScratchDir dir_{"strata-gather"};
  std::unique_ptr<nvme::IoEngine> io_;
  std::unique_ptr<nvme::SwapSpace> swap_;
  std::vector<Chunk> chunks_ = std::vector<Chunk>(kChunks);
  std::optional<ParamGather> gather_;
};

TEST(ParamGatherTest, TakeGathersEveryRanksShardIntoTheWholeChunk) {
  OnEveryRank(Group(kRanks), [](Communicator& comm) {
    Rank rank(comm, /*slots=*/2);
    EXPECT_EQ(rank.gather().SlotExtraBytes(kShard), 0u);  // Host homes, not quantized.
    for (size_t c = 0; c < kChunks; ++c) rank.TakeAndCheck(c);
    EXPECT_EQ(rank.gathered_bytes(), kChunks * kGatherBytes);
  });
}

// With two slots: Take(0) gathers 0 and, ahead, 1 (no slot is left for 2); Take(1) finds 1
// gathered and gathers 2 into the slot 0 gave back.
TEST(ParamGatherTest, TakeGathersTheUpcomingChunksAheadIntoFreeSlots) {
  OnEveryRank(Group(kRanks), [](Communicator& comm) {
    Rank rank(comm, /*slots=*/2);
    rank.TakeAndCheck(0, {1, 2});
    EXPECT_EQ(rank.gathered_bytes(), 2 * kGatherBytes);
    rank.TakeAndCheck(1, {2});
    EXPECT_EQ(rank.gathered_bytes(), 3 * kGatherBytes);
    rank.TakeAndCheck(2);
    EXPECT_EQ(rank.gathered_bytes(), 3 * kGatherBytes);
  });
}

// Both slots hold gathers (0 taken, 1 ahead) when the trainer leaves the order for 2: the
// gather ahead goes, and 1 is gathered again when it comes.
TEST(ParamGatherTest, WhenNoSlotIsFreeTheGatherAheadMakesRoom) {
  OnEveryRank(Group(kRanks), [](Communicator& comm) {
    Rank rank(comm, /*slots=*/2);
    Result<const std::byte*> zero = rank.gather().Take(0, std::vector<size_t>{1});
    ASSERT_TRUE(zero.ok()) << zero.status().ToString();
    rank.TakeAndCheck(2);
    EXPECT_TRUE(HoldsChunk(*zero, 0, kNumel));  // The taken slot was not touched.
    rank.gather().Return(0);
    EXPECT_EQ(rank.gathered_bytes(), 3 * kGatherBytes);
    rank.TakeAndCheck(1);
    EXPECT_EQ(rank.gathered_bytes(), 4 * kGatherBytes);
  });
}

TEST(ParamGatherTest, DiscardThrowsGathersAheadAwaySoNewShardsAreGathered) {
  OnEveryRank(Group(kRanks), [](Communicator& comm) {
    Rank rank(comm, /*slots=*/2);
    rank.TakeAndCheck(0, {1});  // 1 is gathered ahead.
    rank.gather().Discard();    // A step is about to change the shards...
    rank.SetShard(1, 7);        // ...and does.
    rank.TakeAndCheck(1, {}, /*values=*/7);
    EXPECT_EQ(rank.gathered_bytes(), 3 * kGatherBytes);
  });
}

// qwZ: each rank's shard travels quantized; every rank gets the same dequantized values, those
// of quantizing and dequantizing each shard on its own.
TEST(ParamGatherTest, QuantizedWeightsAreEveryRanksShardQuantizedAndDequantized) {
  EngineOptions options;
  options.placement.quantized_weights = true;
  OnEveryRank(Group(kRanks), [&](Communicator& comm) {
    Rank rank(comm, /*slots=*/2, options);
    const size_t one = cpu_adam::QuantizedBytes(kShard, ParamGather::kWeightBits);
    EXPECT_EQ(rank.gather().SlotExtraBytes(kShard),
              AlignUp(one, kHostAlignment) + AlignUp(one * kRanks, kHostAlignment));
    for (size_t c = 0; c < kChunks; ++c) {
      Result<const std::byte*> taken = rank.gather().Take(c, {});
      ASSERT_TRUE(taken.ok()) << taken.status().ToString();
      const auto* got = reinterpret_cast<const float*>(*taken);
      for (int from = 0; from < kRanks; ++from) {
        const AlignedBuffer shard = ChunkValues(c, kShard, size_t(from) * kShard);
        std::vector<std::byte> quantized(one);
        std::vector<float> expected(kShard);
        ASSERT_TRUE(rank.optimizer()
                        .Quantize(shard.data(), DType::kFp32, kShard, ParamGather::kWeightBits,
                                  quantized.data())
                        .ok());
        ASSERT_TRUE(rank.optimizer()
                        .Dequantize(quantized.data(), ParamGather::kWeightBits, kShard,
                                    expected.data(), DType::kFp32)
                        .ok());
        const float* part = got + size_t(from) * kShard;
        for (size_t i = 0; i < kShard; ++i) {  // The same bits (a NaN would compare unequal).
          ASSERT_EQ(std::bit_cast<uint32_t>(part[i]), std::bit_cast<uint32_t>(expected[i]))
              << "chunk " << c << ", the shard of rank " << from << ", element " << i;
        }
        // And close to the exact values: int8 keeps about two digits.
        const auto* exact = reinterpret_cast<const float*>(shard.data());
        for (size_t i = 0; i < kShard; ++i) {
          ASSERT_NEAR(part[i], exact[i], std::abs(exact[i]) * 0.01 + 10.0) << i;
        }
      }
      rank.gather().Return(c);
    }
    EXPECT_EQ(rank.gathered_bytes(), double(kChunks * one * kRanks));
  });
}

// Rank 1's shard of chunk 0 is one element short: the all-gather fails on every rank, naming
// the chunk, and the communicator stays failed. No rank's own part failed: none is told to
// restart by ParamGather itself.
TEST(ParamGatherTest, AFailedCollectiveFailsTheTakeOnEveryRankNamingTheChunk) {
  OnEveryRank(Group(kRanks), [](Communicator& comm) {
    Rank rank(comm, /*slots=*/2);
    if (comm.rank() == 1) --rank.chunk(0).shard.end;
    Result<const std::byte*> failed = rank.gather().Take(0, {});
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(failed.status().code(), StatusCode::kInvalidArgument) << failed.status().ToString();
    EXPECT_NE(failed.status().message().find("gathering the parameters of chunk 0 across ranks"),
              std::string::npos)
        << failed.status().message();
    Result<const std::byte*> later = rank.gather().Take(1, {});
    ASSERT_FALSE(later.ok());
    EXPECT_NE(later.status().code(), StatusCode::kFailedPrecondition) << later.status().ToString();
    EXPECT_NE(later.status().message().find("chunk 1"), std::string::npos);
  });
}

TEST(ParamGatherTest, AfterFailEveryLaterTakeIsRefusedWithoutAGather) {
  OnEveryRank(Group(1), [](Communicator& comm) {
    Rank rank(comm, /*slots=*/2);
    rank.gather().Fail(Internal("the fetch of chunk 0 failed"));
    rank.gather().Fail(Internal("a second failure"));  // The first one is kept.
    Result<const std::byte*> refused = rank.gather().Take(1, {});
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(refused.status().message().find("the fetch of chunk 0 failed"), std::string::npos)
        << refused.status().message();
    EXPECT_EQ(refused.status().message().find("a second failure"), std::string::npos);
    EXPECT_NE(refused.status().message().find("restart the ranks"), std::string::npos);
    EXPECT_EQ(rank.gathered_bytes(), 0.0);
  });
}

// NVMe homes: each rank reads its shard for the gather. When rank 1's read fails, the others
// still gather (rank 1's part is zeros, not stale bytes), rank 1's Take fails naming the read,
// and every later Take on rank 1 is refused.
TEST(ParamGatherTest, NvmeHomeShardsAreReadForTheGatherAndAFailedReadFailsThatRankOnly) {
  OnEveryRank(Group(kRanks), [](Communicator& comm) {
    auto faults = std::make_shared<nvme::FaultPlan>();
    Rank rank(comm, /*slots=*/2, {}, faults);
    EXPECT_EQ(rank.gather().SlotExtraBytes(kShard),
              AlignUp(kShard * sizeof(float), kHostAlignment));
    rank.TakeAndCheck(0);
    EXPECT_EQ(rank.nvme_read_bytes(), double(kShard * sizeof(float)));

    if (comm.rank() == 1) {
      faults->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kRead, .times = -1});
    }
    Result<const std::byte*> taken = rank.gather().Take(1, {});
    if (comm.rank() != 1) {
      ASSERT_TRUE(taken.ok()) << taken.status().ToString();
      const auto* values = reinterpret_cast<const float*>(*taken);
      EXPECT_TRUE(HoldsChunk(values, 1, kShard));
      for (size_t i = kShard; i < 2 * kShard; ++i) ASSERT_EQ(values[i], 0.0f) << i;
      EXPECT_TRUE(HoldsChunk(values + 2 * kShard, 1, kShard, 2 * kShard));
      rank.gather().Return(1);
      return;
    }
    ASSERT_FALSE(taken.ok());
    EXPECT_NE(taken.status().message().find("reading this rank's shard"), std::string::npos)
        << taken.status().message();
    EXPECT_NE(taken.status().message().find("chunk 1"), std::string::npos);
    Result<const std::byte*> refused = rank.gather().Take(2, {});
    EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(rank.gathered_bytes(), 2 * kGatherBytes);  // No third gather on this rank.
  });
}

}  // namespace
}  // namespace strata::offload
