// Tests for strata/offload/tier_budget.h.

#include "strata/offload/tier_budget.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/status.h"
#include "strata/core/tier.h"

namespace strata::offload {
namespace {

void ExpectUsage(const TierBudget& budget, uint64_t want_budget, uint64_t want_used,
                 uint64_t want_peak) {
  const TierUsage usage = budget.usage();
  EXPECT_EQ(usage.budget_bytes, want_budget);
  EXPECT_EQ(usage.used_bytes, want_used);
  EXPECT_EQ(usage.peak_bytes, want_peak);
  EXPECT_EQ(budget.free_bytes(), want_budget - want_used);
}

TEST(TierBudgetTest, StartsEmpty) {
  const TierBudget budget(Tier::kHost, 1000);
  EXPECT_EQ(budget.tier(), Tier::kHost);
  ExpectUsage(budget, 1000, 0, 0);
}

TEST(TierBudgetTest, TryReserveTakesWhatFits) {
  TierBudget budget(Tier::kDevice, 1000);
  EXPECT_TRUE(budget.TryReserve(600));
  ExpectUsage(budget, 1000, 600, 600);

  // 500 does not fit in the 400 left: nothing is taken.
  EXPECT_FALSE(budget.TryReserve(500));
  ExpectUsage(budget, 1000, 600, 600);

  // Exactly the rest fits.
  EXPECT_TRUE(budget.TryReserve(400));
  ExpectUsage(budget, 1000, 1000, 1000);
  EXPECT_FALSE(budget.TryReserve(1));
  ExpectUsage(budget, 1000, 1000, 1000);
}

TEST(TierBudgetTest, ZeroBytesAlwaysFit) {
  TierBudget budget(Tier::kHost, 10);
  EXPECT_TRUE(budget.TryReserve(10));
  EXPECT_TRUE(budget.TryReserve(0));
  ExpectUsage(budget, 10, 10, 10);

  TierBudget none(Tier::kHost, 0);
  EXPECT_TRUE(none.TryReserve(0));
  EXPECT_FALSE(none.TryReserve(1));
  ExpectUsage(none, 0, 0, 0);
}

TEST(TierBudgetTest, MoreThanTheWholeBudgetNeverFits) {
  TierBudget budget(Tier::kNvme, 4 * kGiB);
  EXPECT_FALSE(budget.TryReserve(4 * kGiB + 1));
  EXPECT_FALSE(budget.TryReserve(UINT64_MAX));
  ExpectUsage(budget, 4 * kGiB, 0, 0);
}

TEST(TierBudgetTest, ReleaseGivesBytesBack) {
  TierBudget budget(Tier::kHost, 1000);
  ASSERT_TRUE(budget.TryReserve(700));
  budget.Release(300);
  ExpectUsage(budget, 1000, 400, 700);
  EXPECT_TRUE(budget.TryReserve(600));
  ExpectUsage(budget, 1000, 1000, 1000);
  budget.Release(1000);
  ExpectUsage(budget, 1000, 0, 1000);
}

TEST(TierBudgetTest, PeakIsTheHighWaterMark) {
  TierBudget budget(Tier::kDevice, 1000);
  ASSERT_TRUE(budget.TryReserve(300));
  ASSERT_TRUE(budget.TryReserve(500));
  ExpectUsage(budget, 1000, 800, 800);
  budget.Release(500);
  ExpectUsage(budget, 1000, 300, 800);
  ASSERT_TRUE(budget.TryReserve(200));
  ExpectUsage(budget, 1000, 500, 800);  // Below the old peak: unchanged.
  ASSERT_FALSE(budget.TryReserve(600));
  ExpectUsage(budget, 1000, 500, 800);  // A failed reservation leaves no mark.
  ASSERT_TRUE(budget.TryReserve(450));
  ExpectUsage(budget, 1000, 950, 950);
  budget.Release(950);
  ExpectUsage(budget, 1000, 0, 950);
}

TEST(TierBudgetTest, ReserveSucceedsWhenItFits) {
  TierBudget budget(Tier::kHost, 64 * kMiB);
  EXPECT_TRUE(budget.Reserve(48 * kMiB, "chunk 3 master weights").ok());
  ExpectUsage(budget, 64 * kMiB, 48 * kMiB, 48 * kMiB);
  EXPECT_TRUE(budget.Reserve(16 * kMiB, "chunk 4 master weights").ok());
  ExpectUsage(budget, 64 * kMiB, 64 * kMiB, 64 * kMiB);
}

TEST(TierBudgetTest, ReserveNamesTierPurposeAndSizes) {
  TierBudget host(Tier::kHost, 64 * kMiB);
  ASSERT_TRUE(host.Reserve(48 * kMiB, "chunk 3 master weights").ok());
  const Status status = host.Reserve(32 * kMiB, "chunk 4 master weights");
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(),
            "host memory budget of 64MiB cannot hold chunk 4 master weights (32MiB; 48MiB "
            "already in use)");
  ExpectUsage(host, 64 * kMiB, 48 * kMiB, 48 * kMiB);  // Nothing taken.

  TierBudget device(Tier::kDevice, 1536 * kMiB);
  const Status device_status = device.Reserve(2 * kGiB, "the working parameters of chunk 0");
  EXPECT_EQ(device_status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(device_status.message(),
            "device memory budget of 1.5GiB cannot hold the working parameters of chunk 0 (2GiB; "
            "0B already in use)");

  TierBudget nvme(Tier::kNvme, 1000);
  ASSERT_TRUE(nvme.TryReserve(999));
  const Status nvme_status = nvme.Reserve(2, "swap extent");
  EXPECT_EQ(nvme_status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(nvme_status.message(),
            "nvme memory budget of 1000B cannot hold swap extent (2B; 999B already in use)");
}

TEST(TierBudgetTest, SetBudgetChangesWhatFits) {
  TierBudget budget(Tier::kHost, 100);
  ASSERT_TRUE(budget.TryReserve(100));
  EXPECT_FALSE(budget.TryReserve(1));

  budget.SetBudget(250);
  ExpectUsage(budget, 250, 100, 100);
  EXPECT_TRUE(budget.TryReserve(150));
  EXPECT_FALSE(budget.TryReserve(1));
  ExpectUsage(budget, 250, 250, 250);

  budget.Release(250);
  budget.SetBudget(50);
  ExpectUsage(budget, 50, 0, 250);
  EXPECT_FALSE(budget.TryReserve(51));
  EXPECT_TRUE(budget.TryReserve(50));
  ExpectUsage(budget, 50, 50, 250);

  const Status status = budget.Reserve(1, "a staging buffer");
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(),
            "host memory budget of 50B cannot hold a staging buffer (1B; 50B already in use)");
}

TEST(TierBudgetTest, ConcurrentReserveAndReleaseNeverExceedTheBudget) {
  constexpr uint64_t kBudget = 1000;
  constexpr int kThreads = 4;
  constexpr int kIterations = 20000;
  TierBudget budget(Tier::kHost, kBudget);
  // Bytes reserved and not yet released, counted by the threads themselves: a thread adds after
  // its reservation succeeds and subtracts before it releases, so this never exceeds the budget's
  // own count.
  std::atomic<uint64_t> held{0};
  std::atomic<uint64_t> max_held{0};
  std::atomic<int> successes{0};
  std::atomic<int> failures{0};

  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<uint32_t>(t) + 1);
      std::vector<BudgetReservation> mine;
      for (int i = 0; i < kIterations; ++i) {
        const uint64_t bytes = 1 + rng() % 300;
        const bool use_status = i % 2 == 0;
        const bool reserved =
            use_status ? budget.Reserve(bytes, "a test buffer").ok() : budget.TryReserve(bytes);
        if (reserved) {
          successes.fetch_add(1, std::memory_order_relaxed);
          const uint64_t now = held.fetch_add(bytes) + bytes;
          uint64_t seen = max_held.load();
          while (now > seen && !max_held.compare_exchange_weak(seen, now)) {
          }
          mine.emplace_back(&budget, bytes);
        } else {
          failures.fetch_add(1, std::memory_order_relaxed);
        }
        // Hold up to three reservations; give back the oldest, or all of them now and then.
        if (mine.size() > 3 || (!mine.empty() && rng() % 16 == 0)) {
          const size_t keep = rng() % 2 == 0 ? 0 : mine.size() - 1;
          while (mine.size() > keep) {
            held.fetch_sub(mine.front().bytes());
            mine.erase(mine.begin());
          }
        }
      }
      for (const BudgetReservation& r : mine) held.fetch_sub(r.bytes());
      mine.clear();
    });
  }
  for (std::thread& thread : threads) thread.join();

  const TierUsage usage = budget.usage();
  EXPECT_EQ(usage.budget_bytes, kBudget);
  EXPECT_EQ(usage.used_bytes, 0u);
  EXPECT_EQ(held.load(), 0u);
  EXPECT_LE(usage.peak_bytes, kBudget);
  EXPECT_LE(max_held.load(), kBudget);
  EXPECT_GE(usage.peak_bytes, max_held.load());
  EXPECT_EQ(successes.load() + failures.load(), kThreads * kIterations);
  // With four threads holding up to four reservations of up to 300 bytes, both outcomes occur.
  EXPECT_GT(successes.load(), 0);
  EXPECT_GT(failures.load(), 0);
}

TEST(BudgetReservationTest, DefaultHoldsNothing) {
  BudgetReservation reservation;
  EXPECT_EQ(reservation.bytes(), 0u);
  reservation.Reset();
  EXPECT_EQ(reservation.bytes(), 0u);
}

TEST(BudgetReservationTest, ReleasesOnDestruction) {
  TierBudget budget(Tier::kHost, 1000);
  {
    ASSERT_TRUE(budget.TryReserve(300));
    const BudgetReservation reservation(&budget, 300);
    EXPECT_EQ(reservation.bytes(), 300u);
    ExpectUsage(budget, 1000, 300, 300);
  }
  ExpectUsage(budget, 1000, 0, 300);
}

TEST(BudgetReservationTest, ResetReleasesOnce) {
  TierBudget budget(Tier::kHost, 1000);
  ASSERT_TRUE(budget.TryReserve(400));
  ASSERT_TRUE(budget.TryReserve(100));
  {
    BudgetReservation reservation(&budget, 400);
    reservation.Reset();
    EXPECT_EQ(reservation.bytes(), 0u);
    ExpectUsage(budget, 1000, 100, 500);
    reservation.Reset();
    ExpectUsage(budget, 1000, 100, 500);
  }
  // The destructor of a reset reservation releases nothing more.
  ExpectUsage(budget, 1000, 100, 500);
}

TEST(BudgetReservationTest, MoveConstructionTransfersOwnership) {
  TierBudget budget(Tier::kDevice, 1000);
  ASSERT_TRUE(budget.TryReserve(250));
  ASSERT_TRUE(budget.TryReserve(100));  // Held outside any reservation.
  {
    BudgetReservation first(&budget, 250);
    {
      BudgetReservation second(std::move(first));
      EXPECT_EQ(first.bytes(), 0u);  // NOLINT(bugprone-use-after-move): checks the moved-from.
      EXPECT_EQ(second.bytes(), 250u);
      ExpectUsage(budget, 1000, 350, 350);
    }
    ExpectUsage(budget, 1000, 100, 350);
  }
  // The moved-from reservation releases nothing.
  ExpectUsage(budget, 1000, 100, 350);
}

TEST(BudgetReservationTest, MoveAssignmentReleasesTheOldReservation) {
  TierBudget budget(Tier::kHost, 1000);
  ASSERT_TRUE(budget.TryReserve(300));
  ASSERT_TRUE(budget.TryReserve(200));
  ASSERT_TRUE(budget.TryReserve(50));  // Held outside any reservation.
  {
    BudgetReservation target(&budget, 300);
    BudgetReservation source(&budget, 200);
    target = std::move(source);
    EXPECT_EQ(target.bytes(), 200u);
    EXPECT_EQ(source.bytes(), 0u);  // NOLINT(bugprone-use-after-move): checks the moved-from.
    ExpectUsage(budget, 1000, 250, 550);

    target = BudgetReservation();
    EXPECT_EQ(target.bytes(), 0u);
    ExpectUsage(budget, 1000, 50, 550);
  }
  ExpectUsage(budget, 1000, 50, 550);
}

TEST(BudgetReservationTest, MoveAssignmentAcrossBudgets) {
  TierBudget host(Tier::kHost, 1000);
  TierBudget device(Tier::kDevice, 1000);
  ASSERT_TRUE(host.TryReserve(300));
  ASSERT_TRUE(device.TryReserve(700));
  {
    BudgetReservation reservation(&host, 300);
    reservation = BudgetReservation(&device, 700);
    ExpectUsage(host, 1000, 0, 300);
    ExpectUsage(device, 1000, 700, 700);
  }
  ExpectUsage(device, 1000, 0, 700);
}

TEST(BudgetReservationTest, SelfMoveAssignmentKeepsTheReservation) {
  TierBudget budget(Tier::kHost, 1000);
  ASSERT_TRUE(budget.TryReserve(120));
  {
    BudgetReservation reservation(&budget, 120);
    BudgetReservation& alias = reservation;
    reservation = std::move(alias);
    EXPECT_EQ(reservation.bytes(), 120u);
    ExpectUsage(budget, 1000, 120, 120);
  }
  ExpectUsage(budget, 1000, 0, 120);
}

TEST(BudgetReservationTest, ReservationsInAVector) {
  TierBudget budget(Tier::kHost, 10 * kKiB);
  {
    std::vector<BudgetReservation> reservations;
    for (int i = 0; i < 10; ++i) {
      ASSERT_TRUE(budget.TryReserve(kKiB));
      reservations.emplace_back(&budget, kKiB);  // Reallocation moves them.
    }
    ExpectUsage(budget, 10 * kKiB, 10 * kKiB, 10 * kKiB);
    reservations.erase(reservations.begin(), reservations.begin() + 4);
    ExpectUsage(budget, 10 * kKiB, 6 * kKiB, 10 * kKiB);
  }
  ExpectUsage(budget, 10 * kKiB, 0, 10 * kKiB);
}

}  // namespace
}  // namespace strata::offload
