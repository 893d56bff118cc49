// StatePreloader on its own (step/state_preloader.h): chunks whose optimizer states live in a
// real swap space (a scratch directory, through a fault-injecting backend), the pipeline's
// per-chunk steps, and a staging pool; no engine. What it promises: Start reads ahead the last
// chunks first, skipping those updating, updated or sitting the step out, never more than the
// buffers less one; Take hands over a read ahead (or reads then) with the chunk's states; Drop,
// DropAll and Return give buffers back; a failed read fails its Take, gives its buffer back and
// leaves the chunk to be read again. Which chunks were read is told by the bytes read: every
// chunk's states are of a different power-of-two size.
#include "step/state_preloader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <initializer_list>
#include <memory>
#include <optional>
#include <vector>

#include "part_support.h"
#include "step/chunk_step.h"
#include "strata/nvme/fault_injection.h"
#include "support/scratch_dir.h"

namespace strata::offload {
namespace {

using testing::ChunkValues;
using testing::HoldsChunk;

constexpr size_t kChunks = 4;
constexpr size_t kBaseNumel = 1024;  // Chunk i keeps kBaseNumel << i elements' states.

/// Moves `step` through the phases a chunk's journey takes up to `to` (kUpdating or kUpdated).
void Advance(ChunkStep& step, ChunkPhase to) {
  step.MoveTo(ChunkPhase::kLanding);
  step.MoveTo(ChunkPhase::kArrived);
  step.MoveTo(ChunkPhase::kUpdating);
  if (to == ChunkPhase::kUpdated) step.MoveTo(ChunkPhase::kUpdated);
}

class StatePreloaderTest : public ::testing::Test {
 protected:
  /// kChunks chunks with NVMe-kept states (chunk i's hold ChunkValues(i)) and a pool of
  /// `buffers` staging buffers, as large as the largest chunk's states.
  void Make(size_t buffers) {
    auto io = nvme::IoEngine::Create(
        {.block_size = 64 << 10, .queue_depth = 4, .wrap_backend = [plan = plan_](auto inner) {
           return nvme::CreateFaultInjectingBackend(std::move(inner), plan);
         }});
    ASSERT_TRUE(io.ok()) << io.status().ToString();
    io_ = std::move(io).value();
    auto swap = nvme::SwapSpace::Create({.paths = {dir_.path()}, .bytes_per_path = 8 << 20}, *io_);
    ASSERT_TRUE(swap.ok()) << swap.status().ToString();
    swap_ = std::move(swap).value();
    size_t largest = 0;
    for (size_t i = 0; i < kChunks; ++i) {
      Chunk& c = chunks_[i];
      c.numel = kBaseNumel << i;
      c.shard = {0, c.numel};
      c.placement = {.params = Tier::kDevice, .optimizer_states = Tier::kNvme};
      c.state_extents[0] = std::move(swap_->Allocate(c.state_bytes())).value();
      const AlignedBuffer states = ChunkValues(i, c.state_bytes() / sizeof(float));
      ASSERT_TRUE(swap_->WriteSync(c.state_extent(), states.data(), states.size()).ok());
      largest = std::max(largest, c.state_bytes());
    }
    auto pool = StagingPool::Create({.buffer_bytes = largest, .buffer_count = buffers});
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    pool_ = pool->get();
    preloader_.emplace(chunks_, steps_, metrics_.metrics, work_.spawner());
    preloader_->Open(std::move(pool).value(), *io_, *swap_);
  }
  void TearDown() override {
    if (preloader_) work_.loop().Run(preloader_->DropAll());
    work_.WaitIdle();
    // The I/O thread may still be inside the post of a read's completion that has already run:
    // it is joined before the loop goes (as Engine::Impl's destructor orders it).
    swap_.reset();
    io_.reset();
  }

  /// Start, on the loop, and waits until the reads it started are done.
  void Start(bool participants_known = false) {
    work_.OnLoop([&] { preloader_->Start(participants_known); });
    work_.WaitIdle();
  }
  Result<StagingBuffer> Take(size_t chunk) {
    std::optional<Result<StagingBuffer>> taken;  // (Run needs a value it can default.)
    work_.loop().Run(TakeInto(chunk, taken));
    return std::move(*taken);
  }
  void Return(StagingBuffer& buffer) {
    work_.OnLoop([&] { preloader_->Return(buffer); });
  }
  /// Takes `chunk`'s states, checks them, and gives the buffer back.
  void TakeAndReturn(size_t chunk) {
    Result<StagingBuffer> taken = Take(chunk);
    ASSERT_TRUE(taken.ok()) << taken.status().ToString();
    EXPECT_TRUE(HoldsChunk(taken->data(), chunk, chunks_[chunk].state_bytes() / sizeof(float)));
    Return(*taken);
  }
  double read_bytes() const { return metrics_.metrics.nvme_read_bytes->Value(); }
  /// The bytes of the states of `chunks` together.
  double StateBytes(std::initializer_list<size_t> chunks) const {
    double bytes = 0;
    for (size_t i : chunks) bytes += double(chunks_[i].state_bytes());
    return bytes;
  }

  testing::RegisteredMetrics metrics_;
  strata::testing::ScratchDir dir_{"strata-preloader"};
  std::shared_ptr<nvme::FaultPlan> plan_ = std::make_shared<nvme::FaultPlan>();
  std::unique_ptr<nvme::IoEngine> io_;
  std::unique_ptr<nvme::SwapSpace> swap_;
  std::vector<Chunk> chunks_ = std::vector<Chunk>(kChunks);
  std::vector<ChunkStep> steps_ = std::vector<ChunkStep>(kChunks);
  const StagingPool* pool_ = nullptr;  // The preloader's.
  std::optional<StatePreloader> preloader_;
  testing::LoopWork work_;  // Declared last: its reads end before what they use goes.

 private:
  Awaitable<void> TakeInto(size_t chunk, std::optional<Result<StagingBuffer>>& taken) {
    taken.emplace(co_await preloader_->Take(chunk));
  }
};

TEST_F(StatePreloaderTest, ReadsAheadTheLastChunksFirstAsManyAsTheBuffersLessOne) {
  EXPECT_EQ(StatePreloader::ReadAheadDepth(3), 2u);
  Make(3);
  Start();
  EXPECT_EQ(read_bytes(), StateBytes({3, 2}));
  EXPECT_EQ(pool_->available(), 1u);
  Start();  // Both reads are still held: nothing more.
  EXPECT_EQ(read_bytes(), StateBytes({3, 2}));

  // The last chunk's update takes its read ahead: no new read.
  Advance(steps_[3], ChunkPhase::kUpdating);
  Result<StagingBuffer> taken = Take(3);
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  EXPECT_TRUE(HoldsChunk(taken->data(), 3, chunks_[3].state_bytes() / sizeof(float)));
  EXPECT_EQ(read_bytes(), StateBytes({3, 2}));
  Return(*taken);
  EXPECT_EQ(pool_->available(), 2u);
  // Its buffer back, the next chunk in backward's order is read.
  Start();
  EXPECT_EQ(read_bytes(), StateBytes({3, 2, 1}));
  EXPECT_EQ(pool_->available(), 1u);
  TakeAndReturn(2);
  TakeAndReturn(1);
  EXPECT_EQ(read_bytes(), StateBytes({3, 2, 1}));
  EXPECT_EQ(pool_->available(), 3u);
}

TEST_F(StatePreloaderTest, ChunksUpdatingUpdatedOrSittingTheStepOutAreNotRead) {
  Make(kChunks);  // Room to read three ahead.
  Advance(steps_[3], ChunkPhase::kUpdating);
  Advance(steps_[2], ChunkPhase::kUpdated);
  Start();
  EXPECT_EQ(read_bytes(), StateBytes({1, 0}));
  work_.loop().Run(preloader_->DropAll());
  EXPECT_EQ(pool_->available(), kChunks);

  // Once the step's participants are known, a chunk without gradients (0) reads nothing...
  steps_[1].micro_steps = 1;
  Start(/*participants_known=*/true);
  EXPECT_EQ(read_bytes(), StateBytes({1, 0, 1}));
  // ...until they are not (the commit began: the next step's chunks are the ones to read).
  Start(/*participants_known=*/false);
  EXPECT_EQ(read_bytes(), StateBytes({1, 0, 1, 0}));
  EXPECT_EQ(pool_->available(), kChunks - 2);
}

// The buffer left free serves a chunk that comes out of the expected order: its Take reads it.
TEST_F(StatePreloaderTest, TakeOfAChunkNotReadAheadReadsItIntoTheBufferLeftFree) {
  Make(3);
  Start();
  ASSERT_EQ(read_bytes(), StateBytes({3, 2}));
  Result<StagingBuffer> taken = Take(0);
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  EXPECT_TRUE(HoldsChunk(taken->data(), 0, chunks_[0].state_bytes() / sizeof(float)));
  EXPECT_EQ(read_bytes(), StateBytes({3, 2, 0}));
  EXPECT_EQ(pool_->available(), 0u);
  Return(*taken);
  EXPECT_EQ(pool_->available(), 1u);
}

TEST_F(StatePreloaderTest, DropGivesTheBufferBackAndTheChunkIsReadAgain) {
  Make(3);
  Start();
  work_.loop().Run(preloader_->Drop(0));  // It has no read ahead: nothing changes.
  EXPECT_EQ(pool_->available(), 1u);
  work_.loop().Run(preloader_->Drop(3));  // A chunk that sits the step out.
  EXPECT_EQ(pool_->available(), 2u);
  Start();
  EXPECT_EQ(read_bytes(), StateBytes({3, 2, 3}));
  EXPECT_EQ(pool_->available(), 1u);
  TakeAndReturn(3);
  EXPECT_EQ(read_bytes(), StateBytes({3, 2, 3}));
}

// New states (a Load) make every read stale: DropAll gives every buffer back, reads still in
// flight included, and the next Start reads again.
TEST_F(StatePreloaderTest, DropAllGivesEveryBufferBackReadsInFlightIncluded) {
  Make(3);
  const double before = read_bytes();
  work_.OnLoop([&] { preloader_->Start(false); });  // Not waited for.
  work_.loop().Run(preloader_->DropAll());
  EXPECT_EQ(pool_->available(), 3u);
  work_.WaitIdle();
  EXPECT_EQ(read_bytes(), before + StateBytes({3, 2}));
  Start();
  EXPECT_EQ(read_bytes(), before + StateBytes({3, 2, 3, 2}));
  TakeAndReturn(3);
  TakeAndReturn(2);
  EXPECT_EQ(pool_->available(), 3u);
}

TEST_F(StatePreloaderTest, AFailedReadFailsItsTakeGivesItsBufferBackAndIsReadAgain) {
  Make(2);  // One read ahead: the last chunk's.
  plan_->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kRead, .error = EIO});
  Start();
  EXPECT_EQ(plan_->fired(), 1);
  EXPECT_EQ(read_bytes(), 0.0);
  EXPECT_EQ(pool_->available(), 2u);  // The failed read kept no buffer.
  Result<StagingBuffer> failed = Take(3);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status().ToString();
  EXPECT_EQ(pool_->available(), 2u);
  // The slot is free again: the next Take reads anew, and the fault is gone.
  TakeAndReturn(3);
  EXPECT_EQ(read_bytes(), StateBytes({3}));
  EXPECT_EQ(pool_->available(), 2u);
}

// No states on NVMe: the engine never opens it, and every call is a no-op.
TEST_F(StatePreloaderTest, WithoutOpenNothingIsRead) {
  preloader_.emplace(chunks_, steps_, metrics_.metrics, work_.spawner());
  work_.OnLoop([&] { preloader_->Start(false); });
  work_.loop().Run(preloader_->Drop(0));
  work_.loop().Run(preloader_->DropAll());
  StagingBuffer none;
  Return(none);
  work_.WaitIdle();
  EXPECT_EQ(read_bytes(), 0.0);
}

}  // namespace
}  // namespace strata::offload
