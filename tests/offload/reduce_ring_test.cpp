// ReduceRing on its own (sharding/reduce_ring.h): its slots, the turns its writers wait for on
// the loop, the fill its collectives wait for, and a reduce-scatter over local ranks through
// it; no engine. What it promises: number p uses slot p mod N; the first N numbers have their
// turn at once and number p + N only once p's two ends (writer and reader) are released, strictly
// by number, releases counted per number; WaitFilled returns once its number's writer is done;
// and gradients reduced from its slots are the plain sum over ranks.
#include "sharding/reduce_ring.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "communicator_conformance.h"
#include "part_support.h"

namespace strata::offload {
namespace {

using testing::Group;
using testing::LoopWork;
using testing::OnEveryRank;

constexpr size_t kSlots = 2;

class ReduceRingTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(ring_.Initialize(kSlots, 64, 0, 0).ok()); }
  void TearDown() override { work_.WaitIdle(); }

  /// Waits on the loop for `number`'s turn; Turned() lists the turns that came, in order.
  void AwaitTurn(uint64_t number) { work_.Spawn(Turn(number)); }
  std::vector<uint64_t> Turned() {
    work_.Settle();
    return work_.OnLoop([&] { return turned_; });
  }
  /// Releases one end of `number`'s use of its slot, on the loop.
  void Release(uint64_t number) {
    work_.OnLoop([&] { ring_.Release(number); });
  }
  void ReleaseBothEnds(uint64_t number) {
    Release(number);
    Release(number);
  }

  ReduceRing ring_;
  std::vector<uint64_t> turned_;  // Loop thread.
  LoopWork work_;                 // Declared last: stopped before the ring goes.

 private:
  Awaitable<void> Turn(uint64_t number) {
    co_await ring_.WaitTurn(number);
    turned_.push_back(number);
  }
};

TEST_F(ReduceRingTest, NumberPUsesSlotPModN) {
  EXPECT_EQ(ring_.Next(), 0u);
  EXPECT_EQ(ring_.Next(), 1u);
  EXPECT_EQ(ring_.Next(), 2u);
  EXPECT_EQ(ring_.Input(0), ring_.Input(2));
  EXPECT_EQ(ring_.Input(1), ring_.Input(5));
  EXPECT_NE(ring_.Input(0), ring_.Input(1));

  // Quantized gradients and reducing every micro-step: a sent, a received and an output buffer
  // per slot, as large as asked (a sanitizer checks the writes).
  ReduceRing full;
  ASSERT_TRUE(full.Initialize(3, 64, 128, 16).ok());
  for (uint64_t number = 0; number < 3; ++number) {
    std::fill_n(full.Input(number), 64, 1.0f);
    std::fill_n(full.Sent(number), 128, std::byte{1});
    std::fill_n(full.Received(number), 128, std::byte{2});
    std::fill_n(full.Output(number), 16, 3.0f);
  }
  EXPECT_EQ(full.Sent(1), full.Sent(4));
  EXPECT_NE(full.Sent(1), full.Received(1));
  EXPECT_EQ(full.Output(2), full.Output(5));
  EXPECT_NE(full.Output(0), full.Output(1));
  EXPECT_EQ(full.Input(0)[63], 1.0f);
}

// The ring is full after N numbers: the next waits until the first is done at both ends.
TEST_F(ReduceRingTest, NumberPPlusNWaitsForBothEndsOfP) {
  for (uint64_t number : {0, 1, 2}) AwaitTurn(number);
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1}));
  Release(0);  // Its writer finished; its collective has not read the slot yet.
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1}));
  Release(0);
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1, 2}));
  // Empty again once every number in it is done: the next N have their turn at once.
  ReleaseBothEnds(1);
  ReleaseBothEnds(2);
  AwaitTurn(3);
  AwaitTurn(4);
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1, 2, 3, 4}));
  ReleaseBothEnds(3);
  ReleaseBothEnds(4);
}

// Turns go by number: 3 (slot 1) may go before 2 (slot 0), and 4 waits for 2, not for 3.
TEST_F(ReduceRingTest, TurnsGoByNumberNotByWhichSlotIsFreedFirst) {
  for (uint64_t number : {0, 1}) AwaitTurn(number);
  for (uint64_t number : {4, 2, 3}) AwaitTurn(number);
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1}));
  ReleaseBothEnds(1);
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1, 3}));
  ReleaseBothEnds(0);
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1, 3, 2}));
  ReleaseBothEnds(3);  // Slot 1's: 4 is slot 0's.
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1, 3, 2}));
  ReleaseBothEnds(2);
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1, 3, 2, 4}));
  ReleaseBothEnds(4);
}

// A failed communicator may complete number 3's collective before 3's turn: that release is
// 3's, counted until 3's writer adds the other, not slot 1's.
TEST_F(ReduceRingTest, AReleaseBeforeItsTurnCountsForItsNumber) {
  for (uint64_t number : {0, 1}) AwaitTurn(number);
  Release(3);  // 3's collective failed early.
  Release(1);  // 1's writer.
  AwaitTurn(3);
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1}));
  Release(1);  // 1's collective: now 3's turn.
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1, 3}));
  Release(3);  // 3's writer: 3 is done, and 5 may go at once.
  AwaitTurn(5);
  EXPECT_EQ(Turned(), (std::vector<uint64_t>{0, 1, 3, 5}));
  ReleaseBothEnds(0);
  ReleaseBothEnds(5);
}

/// Runs WaitFilled(`number`) on a thread of its own and MarkFilled(`filled`) from here, then
/// MarkFilled(`number`); returns whether the wait ended only after the second. (The pause only
/// gives a wrong ring the chance to return early.)
bool FilledOnlyByItsOwnNumber(ReduceRing& ring, LoopWork& work, uint64_t number, uint64_t filled) {
  std::atomic<bool> marked{false};
  std::atomic<bool> after{false};
  std::thread collective([&] {
    EXPECT_TRUE(ring.WaitFilled(number).ok());
    after = marked.load();
  });
  work.OnLoop([&] { ring.MarkFilled(filled); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  marked = true;
  work.OnLoop([&] { ring.MarkFilled(number); });
  collective.join();
  return after;
}

TEST_F(ReduceRingTest, WaitFilledReturnsOnceItsOwnNumbersWriterIsDone) {
  // 2's slot is 0's: 0's writer being done says nothing of 2's.
  EXPECT_TRUE(FilledOnlyByItsOwnNumber(ring_, work_, 2, 0));
  // Numbers are not slots: 1's writer says nothing of 3's either.
  EXPECT_TRUE(FilledOnlyByItsOwnNumber(ring_, work_, 3, 1));
  // A later number of the slot done means this one was: no wait.
  EXPECT_TRUE(ring_.WaitFilled(0).ok());
  EXPECT_TRUE(ring_.WaitFilled(2).ok());
}

/// Rank `rank`'s gradient element `i` of chunk `chunk`: small integers, exact in fp32 summed.
float Gradient(int rank, size_t chunk, size_t i) {
  return float(rank * 100 + int(chunk) * 10 + int(i % 7));
}

/// Chunk `chunk`'s writer: once its number's turn comes, fills its slot and says so.
Awaitable<void> Fill(ReduceRing& ring, uint64_t number, int rank, size_t chunk, size_t numel) {
  co_await ring.WaitTurn(number);
  float* input = ring.Input(number);
  for (size_t i = 0; i < numel; ++i) input[i] = Gradient(rank, chunk, i);
  ring.MarkFilled(number);
  ring.Release(number);
}

// Five chunks through two slots on three ranks, as the step pipeline drives the ring: each
// rank's shard of each chunk's reduce-scatter is the plain sum over ranks of their gradients.
TEST(ReduceRingReduceTest, AReduceScatterFromItsSlotsIsThePlainSumOverRanks) {
  constexpr int kRanks = 3;
  constexpr size_t kShard = 700;
  constexpr size_t kNumel = kRanks * kShard;
  constexpr size_t kChunks = 5;
  OnEveryRank(Group(kRanks), [](Communicator& comm) {
    ReduceRing ring;
    ASSERT_TRUE(ring.Initialize(kSlots, kNumel, 0, kShard).ok());
    std::vector<std::vector<float>> results(kChunks);
    std::vector<Status> statuses(kChunks);
    // The reduce-scatters' ends handled on the loop, and their callbacks returned (after their
    // post to the loop, which must not race the loop's destruction).
    std::mutex mutex;
    std::condition_variable changed;
    size_t handled = 0, returned = 0;
    auto count = [&](size_t& counter) {
      std::lock_guard lock(mutex);
      ++counter;
      changed.notify_all();
    };
    LoopWork work;  // Declared last: stopped before what its handlers use goes.
    for (size_t chunk = 0; chunk < kChunks; ++chunk) {
      const uint64_t number = ring.Next();
      work.Spawn(Fill(ring, number, comm.rank(), chunk, kNumel));
      comm.ReduceScatter(
          ring.Input(number), ring.Output(number), kShard, DType::kFp32, ReduceOp::kSum,
          [&ring, number] { return ring.WaitFilled(number); },
          [&, number, chunk](const Status& status) {
            // The reader's end, on the loop: the shard is taken out before the slot is reused.
            boost::asio::post(work.loop().executor(), [&, number, chunk, status] {
              statuses[chunk] = status;
              results[chunk].assign(ring.Output(number), ring.Output(number) + kShard);
              ring.Release(number);
              count(handled);
            });
            count(returned);
          });
    }
    {
      std::unique_lock lock(mutex);
      changed.wait(lock, [&] { return handled == kChunks && returned == kChunks; });
    }
    work.WaitIdle();
    for (size_t chunk = 0; chunk < kChunks; ++chunk) {
      ASSERT_TRUE(statuses[chunk].ok()) << statuses[chunk].ToString();
      for (size_t i = 0; i < kShard; ++i) {
        const size_t element = size_t(comm.rank()) * kShard + i;
        float sum = 0;
        for (int r = 0; r < kRanks; ++r) sum += Gradient(r, chunk, element);
        ASSERT_EQ(results[chunk][i], sum) << "rank " << comm.rank() << ", chunk " << chunk;
      }
    }
  });
}

}  // namespace
}  // namespace strata::offload
