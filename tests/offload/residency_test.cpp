// Residency on its own (residency/residency.h): a HostDevice (wrapped, to fail copies), a device
// budget, chunks with host-home parameters and the loop its fetches run on; no engine. What it
// promises: an Acquire leaves the chunk's home values and zeroed gradients on the device, pinned;
// eviction takes the least recently used chunk while the first step records the order and the one
// used furthest ahead once it is known; prefetch follows the recorded order as deep as the
// options say, never evicting what is needed first; the budget is never exceeded; and a failed
// copy fails its Acquire and leaves the chunk absent, its memory kept for the next fetch.
#include "residency/residency.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "part_support.h"
#include "strata/core/host_device.h"
#include "wrapped_device.h"

namespace strata::offload {
namespace {

using testing::ChunkValues;
using testing::HoldsChunk;
using testing::LoopWork;
using testing::RegisteredMetrics;
using testing::WrappedDevice;

constexpr size_t kNumel = 1024;  // fp32: one 4 KiB page of parameters and one of gradients.
constexpr uint64_t kSlot = 2 * kNumel * sizeof(float);

bool AllZero(const void* data, size_t bytes) {
  const auto* p = static_cast<const std::byte*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    if (p[i] != std::byte{0}) return false;
  }
  return true;
}

class ResidencyTest : public ::testing::Test {
 protected:
  /// `chunks` chunks with host-home parameters (chunk i holds ChunkValues(i)), a device budget
  /// of `slots` resident chunks (the HostDevice has exactly as much memory), and
  /// placement.prefetch_depth `prefetch_depth`.
  void Make(size_t chunks, size_t slots, int prefetch_depth = 0) {
    options_.precision.working_dtype = DType::kFp32;
    options_.placement.prefetch_depth = prefetch_depth;
    host_device_ = std::move(CreateHostDevice({.memory_budget_bytes = slots * kSlot})).value();
    device_.emplace(*host_device_);
    budget_.emplace(Tier::kDevice, slots * kSlot);
    chunks_ = std::vector<Chunk>(chunks);
    for (size_t i = 0; i < chunks; ++i) {
      Chunk& c = chunks_[i];
      c.numel = kNumel;
      c.placement = {.params = Tier::kHost, .optimizer_states = Tier::kHost};
      c.shard = {0, kNumel};
      c.host_params = ChunkValues(i, kNumel);
    }
    zeros_ = ChunkValues(0, 0, 0, kNumel * sizeof(float));
    MakeResidency();
  }
  /// The part over what Make made (again, after a test changed the chunks' placement, which
  /// Initialize reads).
  void MakeResidency() {
    residency_.reset();
    residency_.emplace(Residency::Resources{.options = options_,
                                            .device = *device_,
                                            .device_budget = *budget_,
                                            .chunks = chunks_,
                                            .metrics = metrics_.metrics,
                                            .spawn = work_.spawner()});
    Status initialized = residency_->Initialize(nullptr, nullptr, zeros_);
    ASSERT_TRUE(initialized.ok()) << initialized.ToString();
  }
  void TearDown() override {
    work_.WaitIdle();
    // A stream thread may still be inside the post of a fetch's completion that has already
    // run: it must be done before the loop goes (as Engine::Impl's destructor orders it).
    if (device_) {
      ASSERT_TRUE(device_->Synchronize().ok());
    }
  }

  /// Acquires `chunk`, checks that the device holds its home values, and releases it.
  void Use(size_t chunk) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    Result<ChunkView> view = residency_->Acquire(chunk);
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    EXPECT_TRUE(HoldsChunk(view->params, chunk, kNumel));
    residency_->Release(chunk, {});
  }
  /// Drops every chunk's device copy, once the trainer's work on them has run.
  void DropAll() {
    ASSERT_TRUE(residency_->WaitForTrainerUse().ok());
    std::vector<size_t> all(chunks_.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    residency_->Drop(all);
  }
  double fetches() const { return metrics_.metrics.fetches->Value(); }
  double evictions() const { return metrics_.metrics.evictions->Value(); }
  uint64_t used() const { return budget_->usage().used_bytes; }

  RegisteredMetrics metrics_;
  EngineOptions options_;
  std::unique_ptr<Device> host_device_;
  std::optional<WrappedDevice> device_;
  std::optional<TierBudget> budget_;
  std::vector<Chunk> chunks_;
  AlignedBuffer zeros_;
  std::optional<Residency> residency_;
  LoopWork work_;  // Declared last: its fetches end before what they use goes.
};

TEST_F(ResidencyTest, AcquireLeavesTheHomeValuesAndZeroedGradientsPinnedOnTheDevice) {
  Make(2, 2);
  Result<ChunkView> view = residency_->Acquire(1);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  EXPECT_EQ(view->numel, kNumel);
  EXPECT_EQ(view->dtype, DType::kFp32);
  EXPECT_NE(view->params, chunks_[1].host_params.data());  // A device copy, not the home.
  EXPECT_TRUE(HoldsChunk(view->params, 1, kNumel));
  EXPECT_TRUE(AllZero(view->grads, kNumel * sizeof(float)));
  EXPECT_TRUE(residency_->Held(1));
  EXPECT_FALSE(residency_->Held(0));
  EXPECT_EQ(residency_->FirstAcquired(), std::optional<size_t>(1));
  EXPECT_EQ(used(), kSlot);
  EXPECT_EQ(fetches(), 1.0);
  EXPECT_EQ(metrics_.metrics.h2d_bytes->Value(), double(kSlot));  // Parameters and gradients.
  residency_->Release(1, {});
  EXPECT_FALSE(residency_->Held(1));
  EXPECT_EQ(residency_->FirstAcquired(), std::nullopt);

  // Resident: acquired again, the same copy, with no second fetch.
  Result<ChunkView> again = residency_->Acquire(1);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->params, view->params);
  EXPECT_EQ(fetches(), 1.0);
  residency_->Release(1, {});
}

TEST_F(ResidencyTest, ADeviceHomeChunkIsItsOwnStorageAndTakesNoBudget) {
  Make(1, 1);
  Chunk& c = chunks_[0];
  c.placement.params = Tier::kDevice;
  c.params = std::move(device_->Allocate(kNumel * sizeof(float))).value();
  c.grads = std::move(device_->Allocate(kNumel * sizeof(float))).value();
  MakeResidency();
  Result<ChunkView> view = residency_->Acquire(0);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  EXPECT_EQ(view->params, c.params.data());
  EXPECT_EQ(view->grads, c.grads.data());
  EXPECT_EQ(fetches(), 0.0);
  EXPECT_EQ(used(), 0u);
  residency_->Release(0, {});
  residency_->Drop({0});  // Nothing to drop: it stays.
  view = residency_->Acquire(0);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->params, c.params.data());
  residency_->Release(0, {});
}

// While the first step records the order, the victim is the chunk used least recently.
TEST_F(ResidencyTest, EvictsTheLeastRecentlyUsedWhileTheOrderIsRecorded) {
  Make(3, 2);
  Use(0);
  Use(1);
  Use(0);  // 1 is now the least recently used.
  Use(2);
  EXPECT_EQ(evictions(), 1.0);
  EXPECT_EQ(fetches(), 3.0);
  Use(0);  // Still resident.
  EXPECT_EQ(fetches(), 3.0);
  Use(1);  // Was evicted.
  EXPECT_EQ(fetches(), 4.0);
  EXPECT_EQ(budget_->usage().peak_bytes, 2 * kSlot);
}

// Once the order is known (the first step committed), the victim is the resident chunk whose
// next use is furthest ahead (Belady), which here is not the least recently used one.
TEST_F(ResidencyTest, EvictsTheChunkUsedFurthestAheadOnceTheOrderIsKnown) {
  Make(3, 2);
  // Recorded: 0 1 2 0. Least recently used goes: 0 for 2, then 1 for 0; 2 and 0 stay.
  for (size_t chunk : {0, 1, 2, 0}) Use(chunk);
  EXPECT_EQ(fetches(), 4.0);
  EXPECT_EQ(evictions(), 2.0);
  residency_->StepCommitted();

  Use(0);  // Resident.
  EXPECT_EQ(fetches(), 4.0);
  // For 1, one of 2 (next use right after) and 0 (used last, least recently used now: 2)
  // goes: Belady takes 0.
  Use(1);
  EXPECT_EQ(fetches(), 5.0);
  EXPECT_EQ(evictions(), 3.0);
  Use(2);  // Kept.
  EXPECT_EQ(fetches(), 5.0);
  Use(0);  // Evicted for 1.
  EXPECT_EQ(fetches(), 6.0);
}

// Known order, prefetch_depth 1: each Acquire fetches the next chunk of the order, and only it.
TEST_F(ResidencyTest, PrefetchesTheNextChunksOfTheRecordedOrderAsDeepAsTheOptionsSay) {
  Make(4, 4, /*prefetch_depth=*/1);
  for (size_t chunk : {0, 1, 2, 3}) Use(chunk);
  EXPECT_EQ(fetches(), 4.0);  // Nothing prefetched while the order is recorded.
  DropAll();
  residency_->StepCommitted();

  Use(0);
  work_.WaitIdle();
  EXPECT_EQ(fetches(), 6.0);  // 0 and the prefetch of 1: not 2.
  Use(1);
  work_.WaitIdle();
  EXPECT_EQ(fetches(), 7.0);  // 1 was there; 2 prefetched.
  Use(2);
  Use(3);
  work_.WaitIdle();
  EXPECT_EQ(fetches(), 8.0);  // Each chunk once.
}

// The order 0 1 2, with room for two: fetching 0 evicts 2 (needed last); a prefetch of 2 would
// have to evict 1, needed before it, so it waits until 1 is acquired and 0 can go.
TEST_F(ResidencyTest, APrefetchNeverEvictsAChunkNeededBeforeTheOneItFetches) {
  Make(3, 2, /*prefetch_depth=*/2);
  for (size_t chunk : {0, 1, 2}) Use(chunk);  // 0 evicted for 2: 1 and 2 resident.
  residency_->StepCommitted();

  Use(0);  // Evicts 2 (furthest ahead); 1 is resident; 2 finds no room that 1 may give.
  work_.WaitIdle();
  EXPECT_EQ(fetches(), 4.0);
  EXPECT_EQ(evictions(), 2.0);
  Use(1);  // Still resident; now 2 is prefetched in 0's place (not needed again this step).
  work_.WaitIdle();
  EXPECT_EQ(fetches(), 5.0);
  Use(2);
  EXPECT_EQ(fetches(), 5.0);
}

// Forward and backward over five chunks with room for two, prefetching two ahead: every view
// holds its chunk's values, and neither the budget nor the device's memory (as large) is
// exceeded.
TEST_F(ResidencyTest, NeverHoldsMoreThanTheDeviceBudget) {
  Make(5, 2, /*prefetch_depth=*/2);
  const std::vector<size_t> order = {0, 1, 2, 3, 4, 4, 3, 2, 1, 0};
  for (int step = 0; step < 3; ++step) {
    for (size_t chunk : order) Use(chunk);
    residency_->StepCommitted();
    EXPECT_LE(used(), 2 * kSlot);
  }
  work_.WaitIdle();
  EXPECT_EQ(budget_->usage().peak_bytes, 2 * kSlot);
  EXPECT_GT(evictions(), 0.0);
}

TEST_F(ResidencyTest, AnAcquireBeyondTheBudgetWithEveryChunkHeldIsResourceExhausted) {
  Make(3, 2);
  ASSERT_TRUE(residency_->Acquire(0).ok());
  ASSERT_TRUE(residency_->Acquire(1).ok());
  Result<ChunkView> refused = residency_->Acquire(2);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("cannot hold chunk 2"), std::string::npos)
      << refused.status().message();
  EXPECT_NE(refused.status().message().find("while chunks 0 1 are acquired"), std::string::npos)
      << refused.status().message();
  EXPECT_FALSE(residency_->Held(2));
  EXPECT_EQ(used(), 2 * kSlot);
  EXPECT_EQ(evictions(), 0.0);

  // Released, 0 makes room.
  residency_->Release(0, {});
  Use(2);
  EXPECT_EQ(evictions(), 1.0);
  EXPECT_TRUE(residency_->Held(1));
  residency_->Release(1, {});
}

// A copy that fails fails its Acquire, naming the chunk; the chunk is absent and not held, and
// the memory taken for it is kept (within the budget) for the next fetch, which succeeds.
TEST_F(ResidencyTest, AFailedCopyFailsTheAcquireAndTheNextFetchReusesItsMemory) {
  Make(2, 2);
  device_->FailCopiesToDevice(/*skip=*/0);
  Result<ChunkView> failed = residency_->Acquire(0);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_NE(failed.status().message().find("fetching the parameters of chunk 0"), std::string::npos)
      << failed.status().message();
  EXPECT_EQ(device_->failed_copies(), 1);
  EXPECT_FALSE(residency_->Held(0));
  EXPECT_EQ(residency_->FirstAcquired(), std::nullopt);
  EXPECT_EQ(fetches(), 0.0);
  EXPECT_EQ(used(), kSlot);
  EXPECT_EQ(device_->allocations(), 2);  // Parameters and gradients.

  Use(0);
  EXPECT_EQ(fetches(), 1.0);
  EXPECT_EQ(used(), kSlot);
  EXPECT_EQ(device_->allocations(), 2);
}

// Drop (a commit made the device copies stale): the next Acquire fetches the home's new values,
// into the same memory, with the gradients cleared again.
TEST_F(ResidencyTest, AfterDropTheNextAcquireFetchesTheNewHomeValues) {
  Make(1, 1);
  Result<ChunkView> view = residency_->Acquire(0);
  ASSERT_TRUE(view.ok());
  std::memset(view->grads, 0x7F, kNumel * sizeof(float));  // Backward wrote gradients.
  residency_->Release(0, {});
  chunks_[0].host_params = ChunkValues(7, kNumel);  // The step's new parameters.
  DropAll();
  Result<ChunkView> fresh = residency_->Acquire(0);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->params, view->params);  // The spare memory, again.
  EXPECT_TRUE(HoldsChunk(fresh->params, 7, kNumel));
  EXPECT_TRUE(AllZero(fresh->grads, kNumel * sizeof(float)));
  EXPECT_EQ(fetches(), 2.0);
  residency_->Release(0, {});
}

TEST_F(ResidencyTest, PinGradsNeedsTheChunkAcquiredAndOnceAnAcquire) {
  Make(1, 1);
  EXPECT_EQ(residency_->PinGrads(0).status().code(), StatusCode::kFailedPrecondition);
  Result<ChunkView> view = residency_->Acquire(0);
  ASSERT_TRUE(view.ok());
  Result<ChunkView> pinned = residency_->PinGrads(0);
  ASSERT_TRUE(pinned.ok());
  EXPECT_EQ(pinned->grads, view->grads);
  Result<ChunkView> twice = residency_->PinGrads(0);
  EXPECT_EQ(twice.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(twice.status().message().find("twice under one Acquire"), std::string::npos);
  residency_->UnpinGrads(0);
  residency_->Release(0, {});
}

/// Runs `acquire` on a thread of its own while the gradient copy of a chunk holds its buffer,
/// and ends the copy (UnpinGrads) from here; returns whether `acquire` returned only after.
/// (The pause only gives a wrong Residency the chance to return early.)
bool ReturnsOnlyAfterTheCopyEnds(Residency& residency, size_t copying,
                                 const std::function<void()>& acquire) {
  std::atomic<bool> unpinned{false};
  std::atomic<bool> after{false};
  std::thread trainer([&] {
    acquire();
    after = unpinned.load();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  unpinned = true;
  residency.UnpinGrads(copying);
  trainer.join();
  return after;
}

// The next micro-step's backward writes the gradient buffer that the last one's copy reads:
// Acquire waits for that copy.
TEST_F(ResidencyTest, AnAcquireWaitsForThePreviousMicroStepsGradientCopy) {
  Make(1, 1);
  ASSERT_TRUE(residency_->Acquire(0).ok());
  ASSERT_TRUE(residency_->PinGrads(0).ok());
  residency_->Release(0, {});
  EXPECT_TRUE(ReturnsOnlyAfterTheCopyEnds(*residency_, 0, [&] { Use(0); }));
}

// A chunk whose gradients are being copied out is no victim: an Acquire that needs its room
// waits for the copy, then evicts it.
TEST_F(ResidencyTest, AChunkWhoseGradientsAreCopyingIsNotEvicted) {
  Make(2, 1);
  ASSERT_TRUE(residency_->Acquire(0).ok());
  ASSERT_TRUE(residency_->PinGrads(0).ok());
  residency_->Release(0, {});
  EXPECT_TRUE(ReturnsOnlyAfterTheCopyEnds(*residency_, 0, [&] { Use(1); }));
  EXPECT_EQ(evictions(), 1.0);
  EXPECT_EQ(used(), kSlot);
}

// Stage 3: a sharded chunk's home is a shard; its fetch copies what its Acquire gathered.
// Upcoming names the sharded chunks that the recorded order expects next, skipping held ones.
TEST_F(ResidencyTest, AShardedChunkIsFetchedFromWhatItsAcquireGathered) {
  Make(3, 3);
  std::vector<AlignedBuffer> gathered;
  for (size_t i = 0; i < 3; ++i) {
    chunks_[i].params_sharded = true;
    gathered.push_back(ChunkValues(10 + i, kNumel));
  }
  auto use = [&](size_t chunk) {
    Result<ChunkView> view = residency_->Acquire(chunk, gathered[chunk].data());
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    EXPECT_TRUE(HoldsChunk(view->params, 10 + chunk, kNumel));
    residency_->Release(chunk, {});
  };
  EXPECT_TRUE(residency_->Upcoming(0, 2).empty());  // No order yet.
  for (size_t chunk : {0, 1, 0, 2}) use(chunk);
  residency_->StepCommitted();
  EXPECT_EQ(residency_->Upcoming(0, 1), std::vector<size_t>({1}));
  EXPECT_EQ(residency_->Upcoming(0, 5), std::vector<size_t>({1, 0, 2}));
  ASSERT_TRUE(residency_->Acquire(0, gathered[0].data()).ok());
  EXPECT_EQ(residency_->Upcoming(1, 5), std::vector<size_t>({2}));  // 0 is held.
  residency_->Release(0, {});

  // A drop (the shards changed): the next Acquire copies its new gather.
  DropAll();
  gathered[1] = ChunkValues(20, kNumel);
  Result<ChunkView> view = residency_->Acquire(1, gathered[1].data());
  ASSERT_TRUE(view.ok());
  EXPECT_TRUE(HoldsChunk(view->params, 20, kNumel));
  residency_->Release(1, {});
}

}  // namespace
}  // namespace strata::offload
