// Every injected fault gives the right status, leaves other data intact, and a retry after a
// transient fault succeeds.
#include "strata/nvme/fault_injection.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

#include "nvme_test_support.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_space.h"

namespace strata::nvme {
namespace {

using testing::Pattern;
using testing::ScratchDir;
using testing::Zeroed;

class FaultInjectionTest : public ::testing::TestWithParam<NvmeBackend> {
 protected:
  void SetUp() override {
    plan_ = std::make_shared<FaultPlan>();
    auto engine = IoEngine::Create({.backend = GetParam(),
                                    .block_size = 64 << 10,
                                    .queue_depth = 4,
                                    .wrap_backend = [plan = plan_](auto inner) {
                                      return CreateFaultInjectingBackend(std::move(inner), plan);
                                    }});
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    engine_ = std::move(engine).value();
    auto swap = SwapSpace::Create({.paths = {dir_.path()}, .bytes_per_path = 8 << 20}, *engine_);
    ASSERT_TRUE(swap.ok()) << swap.status().ToString();
    swap_ = std::move(swap).value();
  }

  /// Writes a pattern into a fresh 1 MiB extent; returns it.
  ExtentId Written(uint32_t seed, AlignedBuffer& data) {
    data = Pattern(1 << 20, seed);
    ExtentId extent = *swap_->Allocate(data.size());
    EXPECT_TRUE(swap_->WriteSync(extent, data.data(), data.size()).ok());
    return extent;
  }

  ScratchDir dir_;
  std::shared_ptr<FaultPlan> plan_;
  std::unique_ptr<IoEngine> engine_;
  std::unique_ptr<SwapSpace> swap_;
};

TEST_P(FaultInjectionTest, EioOnReadFailsThatReadOnlyAndRetrySucceeds) {
  AlignedBuffer a, b;
  ExtentId first = Written(1, a);
  ExtentId second = Written(2, b);
  plan_->Add({.kind = FaultKind::kError, .op = IoOp::kRead, .error = EIO});
  AlignedBuffer back = Zeroed(1 << 20);
  Status status = swap_->ReadSync(first, back.data());
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(status.message().find("Input/output error"), std::string::npos) << status.message();
  EXPECT_EQ(plan_->fired(), 1);
  // The other extent is intact, and the transient fault is gone on retry.
  ASSERT_TRUE(swap_->ReadSync(second, back.data()).ok());
  EXPECT_EQ(std::memcmp(back.data(), b.data(), b.size()), 0);
  ASSERT_TRUE(swap_->ReadSync(first, back.data()).ok());
  EXPECT_EQ(std::memcmp(back.data(), a.data(), a.size()), 0);
}

TEST_P(FaultInjectionTest, EnospcOnWriteKeepsPreviousContents) {
  AlignedBuffer a;
  ExtentId extent = Written(1, a);
  plan_->Add({.kind = FaultKind::kError, .op = IoOp::kWrite, .skip = 3, .error = ENOSPC});
  AlignedBuffer other = Pattern(1 << 20, 9);
  Status status = swap_->WriteSync(extent, other.data(), other.size());
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(status.message().find("No space left"), std::string::npos) << status.message();
  // A failed write does not update the extent's record; reading now sees a mix on disk and
  // must say so rather than return it.
  AlignedBuffer back = Zeroed(1 << 20);
  EXPECT_EQ(swap_->ReadSync(extent, back.data()).code(), StatusCode::kDataLoss);
  // Retrying the write succeeds and the data is right again.
  ASSERT_TRUE(swap_->WriteSync(extent, other.data(), other.size()).ok());
  ASSERT_TRUE(swap_->ReadSync(extent, back.data()).ok());
  EXPECT_EQ(std::memcmp(back.data(), other.data(), other.size()), 0);
}

TEST_P(FaultInjectionTest, ShortTransfersContinueWhereTheyStopped) {
  plan_->Add(
      {.kind = FaultKind::kShortTransfer, .op = IoOp::kWrite, .times = 5, .short_bytes = 4096});
  plan_->Add(
      {.kind = FaultKind::kShortTransfer, .op = IoOp::kRead, .times = 5, .short_bytes = 8192});
  AlignedBuffer data;
  ExtentId extent = Written(4, data);
  AlignedBuffer back = Zeroed(1 << 20);
  ASSERT_TRUE(swap_->ReadSync(extent, back.data()).ok());
  EXPECT_EQ(plan_->fired(), 10);
  EXPECT_EQ(std::memcmp(back.data(), data.data(), data.size()), 0);
}

TEST_P(FaultInjectionTest, DelayedCompletionsStillComplete) {
  AlignedBuffer data;
  ExtentId extent = Written(5, data);
  plan_->Add({.kind = FaultKind::kDelay,
              .op = IoOp::kRead,
              .times = 3,
              .delay = std::chrono::milliseconds(30)});
  AlignedBuffer back = Zeroed(1 << 20);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(swap_->ReadSync(extent, back.data()).ok());
  EXPECT_EQ(plan_->fired(), 3);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(30));
  EXPECT_EQ(std::memcmp(back.data(), data.data(), data.size()), 0);
}

TEST_P(FaultInjectionTest, FlippedBitIsDataLossNamingTheExtent) {
  AlignedBuffer data;
  ExtentId extent = Written(6, data);
  plan_->Add({.kind = FaultKind::kCorruptRead});
  AlignedBuffer back = Zeroed(1 << 20);
  Status status = swap_->ReadSync(extent, back.data());
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_NE(status.message().find("extent " + std::to_string(extent.index)), std::string::npos);
  EXPECT_NE(status.message().find("checksum mismatch"), std::string::npos);
  ASSERT_TRUE(swap_->ReadSync(extent, back.data()).ok()) << "the data on disk was fine";
}

INSTANTIATE_TEST_SUITE_P(Backends, FaultInjectionTest,
                         ::testing::Values(NvmeBackend::kIoUring, NvmeBackend::kPosix),
                         testing::BackendName);

}  // namespace
}  // namespace strata::nvme
