// The engine's contract on the paths a straight training loop does not take: views held across
// Step or Load, retries after failures at every stage, reads while updates run, hyper-parameters
// changed mid-step, readers on other threads, devices that are not what the options say, and
// fp16 runs that cannot make progress.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <optional>
#include <thread>

#include "engine_test_support.h"
#include "strata/nvme/fault_injection.h"
#include "support/scratch_dir.h"
#include "tiny_model.h"
#include "wrapped_device.h"

namespace strata::offload {
namespace {

using strata::testing::ScratchDir;
using testing::BitEqual;
using testing::EngineTrainer;
using testing::FaultyNvme;
using testing::kBatch;
using testing::kLayers;
using testing::kSlotBytes;
using testing::kWidth;
using testing::MakeDevice;
using testing::MakeEngine;
using testing::MakeOptions;
using testing::MaxAbsDiff;
using testing::ReferenceTrainer;
using testing::TinyModel;
using testing::WrappedDevice;
using namespace std::chrono_literals;

/// Backward over every chunk without writing gradients, leaving `keep` acquired (its view is
/// returned).
Result<ChunkView> BackwardKeeping(Engine& engine, size_t keep) {
  ChunkView kept;
  for (size_t c = engine.chunk_count(); c-- > 0;) {
    STRATA_ASSIGN_OR_RETURN(ChunkView view, engine.Acquire(c));
    STRATA_RETURN_IF_ERROR(engine.GradsReady(c));
    if (c == keep) {
      kept = view;
    } else {
      engine.Release(c);
    }
  }
  return kept;
}

/// A kernel the trainer queued on a chunk's working parameters: it reads them after `delay`, so
/// a test can tell whether the engine rewrote them before the kernel had run. Its read is a copy
/// on the device's compute stream into staging memory (pinned on a GPU, so that queuing it does
/// not wait for it), so it is a kernel on a GPU as on a HostDevice.
class QueuedRead {
 public:
  QueuedRead(Device& device, const ChunkView& view)
      : device_(device), params_(view.params), bytes_(view.numel * sizeof(float)),
        before_(bytes_) {
    EXPECT_TRUE(testing::ReadDeviceMemory(device_, params_, before_.data(), bytes_).ok());
  }
  /// Queues the kernel; on a GPU, fails if queuing it waited for it (the test would then test
  /// nothing: a HostDevice's copies are always queued).
  Status Queue(std::chrono::milliseconds delay = 100ms) {
    STRATA_ASSIGN_OR_RETURN(seen_, testing::StagingBuffer::Create(device_, bytes_));
    const auto start = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(device_.LaunchHostFunction(
        Stream::kCompute, [delay] { std::this_thread::sleep_for(delay); }));
    STRATA_RETURN_IF_ERROR(device_.CopyToHost(seen_->data(), params_, bytes_, Stream::kCompute));
    if (!testing::InPlace(device_) && std::chrono::steady_clock::now() - start >= delay) {
      return Internal("queuing the kernel's read waited for it");
    }
    return Status();
  }
  /// Once the stream has run it: whether the kernel saw the weights as they were when queued.
  bool SawTheOldWeights() const {
    return seen_ && std::memcmp(seen_->data(), before_.data(), bytes_) == 0;
  }
  /// Whether the weights are the old ones now.
  bool WeightsUnchanged() const {
    std::vector<std::byte> now(bytes_);
    EXPECT_TRUE(testing::ReadDeviceMemory(device_, params_, now.data(), bytes_).ok());
    return std::memcmp(now.data(), before_.data(), bytes_) == 0;
  }

 private:
  Device& device_;
  const void* params_;
  size_t bytes_;
  std::vector<std::byte> before_;
  std::optional<testing::StagingBuffer> seen_;
};

bool Mentions(const Status& status, const std::string& text) {
  return status.message().find(text) != std::string::npos;
}

// Defect 1: a view held across Step() or Load() would dangle once the commit drops offloaded
// copies. Both refuse, naming the chunk.
// The trainer contract on each device: views held across Step and Load, the trainer's queued
// work, retries.
class ContractOnDeviceTest : public testing::OnDeviceTest {};
STRATA_INSTANTIATE_ON_EACH_DEVICE(ContractOnDeviceTest);

TEST_P(ContractOnDeviceTest, StepAndLoadRefuseWhileAChunkIsAcquired) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions({"params_host", Tier::kHost, Tier::kHost}, dir.path());
  auto device = MakeDevice(2 * kSlotBytes);
  ASSERT_NE(device, nullptr);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());
  ASSERT_TRUE(engine->Save(dir.path() / "ckpt").ok());

  ASSERT_TRUE(BackwardKeeping(*engine, 0).ok());
  Result<StepReport> refused = engine->Step().get();
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition)
      << refused.status().ToString();
  EXPECT_TRUE(Mentions(refused.status(), "chunk 0")) << refused.status().ToString();
  engine->Release(0);
  Result<StepReport> stepped = engine->Step().get();
  ASSERT_TRUE(stepped.ok()) << stepped.status().ToString();
  EXPECT_EQ(stepped->step, 2);

  ASSERT_TRUE(engine->Acquire(2).ok());
  Status load = engine->Load(dir.path() / "ckpt");
  EXPECT_EQ(load.code(), StatusCode::kFailedPrecondition) << load.ToString();
  EXPECT_TRUE(Mentions(load, "chunk 2")) << load.ToString();
  EXPECT_EQ(engine->step_count(), 2);
  engine->Release(2);
  ASSERT_TRUE(engine->Load(dir.path() / "ckpt").ok());
  EXPECT_EQ(engine->step_count(), 1);
}

// Defect 1: a chunk released with device work still queued on it must not be freed by the
// step's commit before that work has run (AddressSanitizer sees the read of freed memory).
TEST_P(ContractOnDeviceTest, TheCommitWaitsForTheTrainersLastUseOfAChunk) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions({"params_host", Tier::kHost, Tier::kHost}, dir.path());
  auto device = MakeDevice(2 * kSlotBytes);
  ASSERT_NE(device, nullptr);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());

  Result<ChunkView> view = BackwardKeeping(*engine, 0);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  // The trainer's last kernel on chunk 0, still queued when Step() is called.
  QueuedRead kernel(*device, *view);
  ASSERT_TRUE(kernel.Queue().ok());
  engine->Release(0);
  Result<StepReport> stepped = engine->Step().get();
  ASSERT_TRUE(stepped.ok()) << stepped.status().ToString();
  ASSERT_TRUE(device->SynchronizeStream(Stream::kCompute).ok());
  EXPECT_TRUE(kernel.SawTheOldWeights());
}

// Defect 2: a step that fails after some chunks' optimizer ran is retried without stepping
// those chunks twice, in every placement, whatever failed.
struct RetryCase {
  const char* name;
  Tier states;
  Tier params;
  uint64_t device_budget;
  bool nvme_write_fails;  // Else a host-to-device copy fails.
};

class RetriedStepTest
    : public ::testing::TestWithParam<std::tuple<testing::DeviceUnderTest, RetryCase>> {
 protected:
  void SetUp() override { STRATA_SKIP_UNLESS_USABLE(std::get<0>(GetParam())); }
};

TEST_P(RetriedStepTest, AppliesTheOptimizerOnce) {
  const RetryCase& c = std::get<1>(GetParam());
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options =
      MakeOptions({c.name, c.states, c.params, 1.0, c.device_budget}, dir.path());
  auto plan = std::make_shared<nvme::FaultPlan>();
  auto inner = testing::MakeDeviceUnderTest(std::get<0>(GetParam()), c.device_budget);
  ASSERT_NE(inner, nullptr);
  WrappedDevice device(*inner);
  auto engine = MakeEngine(options, device, model, FaultyNvme(plan));
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  ReferenceTrainer reference(model, options);
  double loss = 0.0;
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
    reference.TrainStep(step);
  }

  // The third chunk's write or upload fails; the first two have been stepped by then. Updates
  // start during backward, so the fault is armed before it.
  if (c.nvme_write_fails) {
    plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kWrite, .skip = 2, .error = EIO});
  } else {
    device.FailCopiesToDevice(/*skip=*/2);
  }
  ASSERT_TRUE(trainer.ForwardBackward(2, &loss).ok());
  Result<StepReport> failed = engine->Step().get();
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status().ToString();
  EXPECT_EQ(plan->fired() + device.failed_copies(), 1);
  EXPECT_EQ(engine->step_count(), 2);

  Result<StepReport> retried = engine->Step().get();
  ASSERT_TRUE(retried.ok()) << retried.status().ToString();
  EXPECT_EQ(retried->step, 3);
  reference.TrainStep(2);
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()))
      << "max |diff| " << MaxAbsDiff(trainer.MasterParameters(), reference.master());
  // The parameters the device got are the new ones: the next losses agree.
  for (int step = 3; step < 5; ++step) {
    ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
    EXPECT_EQ(loss, reference.TrainStep(step)) << "step " << step;
  }
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()));
}

void PrintTo(const RetryCase& c, std::ostream* out) { *out << c.name; }

const RetryCase kRetryCases[] = {
    {"states_host_params_nvme_write", Tier::kHost, Tier::kNvme, 3 * kSlotBytes, true},
    {"states_host_upload", Tier::kHost, Tier::kDevice, 64 << 20, false},
    {"states_nvme_upload", Tier::kNvme, Tier::kDevice, 64 << 20, false},
    {"states_nvme_write", Tier::kNvme, Tier::kDevice, 64 << 20, true},
};
std::string RetryCaseName(
    const ::testing::TestParamInfo<std::tuple<testing::DeviceUnderTest, RetryCase>>& param) {
  return std::get<1>(param.param).name;
}
INSTANTIATE_TEST_SUITE_P(Host, RetriedStepTest,
                         ::testing::Combine(::testing::Values(testing::DeviceUnderTest::kHost),
                                            ::testing::ValuesIn(kRetryCases)),
                         RetryCaseName);
INSTANTIATE_TEST_SUITE_P(Cuda, RetriedStepTest,
                         ::testing::Combine(::testing::Values(testing::DeviceUnderTest::kCuda),
                                            ::testing::ValuesIn(kRetryCases)),
                         RetryCaseName);

// Defect 3: the device passed decides what runs where, not options.device.kind.
TEST(EngineContractTest, ACudaDeviceIsTreatedAsOneWhateverTheOptionsSay) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  auto inner = MakeDevice(64 << 20);
  WrappedDevice cuda(*inner);
  cuda.ReportKind(DeviceKind::kCuda);
  const auto specs = model.Specs();
  for (double ratio : {1.0, 0.5}) {
    EngineOptions options = MakeOptions({"device", Tier::kDevice, Tier::kDevice}, dir.path());
    if (ratio < 1.0)
      options = MakeOptions({"ratio", Tier::kHost, Tier::kDevice, ratio}, dir.path());
    ASSERT_EQ(options.device.kind, DeviceKind::kHost);
    auto engine = Engine::Create(options, cuda, specs);
    ASSERT_FALSE(engine.ok()) << "ratio " << ratio;
    EXPECT_EQ(engine.status().code(), StatusCode::kUnavailable) << engine.status().ToString();
    EXPECT_TRUE(Mentions(engine.status(), "a cuda device")) << engine.status().ToString();
  }
}

// Defect 4: the engine budgets what the device may still hand out, not what its hardware has
// free, so a fetch evicts instead of failing in Allocate.
TEST(EngineContractTest, TheDeviceBudgetIsTheDevicesOwn) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options =
      MakeOptions({"params_host", Tier::kHost, Tier::kHost, 1.0, 2 * kSlotBytes}, dir.path());
  auto inner = MakeDevice(2 * kSlotBytes);
  WrappedDevice device(*inner);
  device.ReportHardwareFree(uint64_t(64) << 30);
  auto engine = MakeEngine(options, device, model);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->tier_usage(Tier::kDevice).budget_bytes, 2 * kSlotBytes);
  EngineTrainer trainer(*engine, model);
  ReferenceTrainer reference(model, options);
  for (int step = 0; step < 3; ++step) {
    double loss = 0.0;
    Result<StepReport> report = trainer.TrainStep(step, &loss);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(loss, reference.TrainStep(step));
  }
  EXPECT_GT(engine->counters().evictions, 0u);
}

// Defect 5: Load writes NVMe-home state into the shadow extents and switches only when every
// chunk is in, so an I/O error half-way leaves the engine as it was.
TEST(EngineContractTest, ALoadThatFailsHalfWayChangesNothing) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options =
      MakeOptions({"nvme", Tier::kNvme, Tier::kNvme, 1.0, 3 * kSlotBytes}, dir.path());
  auto plan = std::make_shared<nvme::FaultPlan>();
  auto device = MakeDevice(3 * kSlotBytes);
  auto engine = MakeEngine(options, *device, model, FaultyNvme(plan));
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  ReferenceTrainer reference(model, options);
  double loss = 0.0;
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
    reference.TrainStep(step);
  }
  ASSERT_TRUE(engine->Save(dir.path() / "ckpt").ok());
  ASSERT_TRUE(trainer.TrainStep(2, &loss).ok());  // The reference stays at the checkpoint.
  const auto before = trainer.MasterParameters();

  plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kWrite, .skip = 4, .error = EIO});
  Status failed = engine->Load(dir.path() / "ckpt");
  EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed.ToString();
  EXPECT_EQ(plan->fired(), 1);
  EXPECT_EQ(engine->step_count(), 3);
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), before)) << "a failed load changed state";

  ASSERT_TRUE(engine->Load(dir.path() / "ckpt").ok());
  EXPECT_EQ(engine->step_count(), 2);
  for (int step = 2; step < 5; ++step) {
    ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
    EXPECT_EQ(loss, reference.TrainStep(step)) << "step " << step;
  }
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()));
}

// Defect 6: from its last GradsReady to the step's completion a chunk may be mid-update; reads
// of its parameters or master are refused rather than racing the update.
TEST(EngineContractTest, AChunkWhoseUpdateMayRunCannotBeRead) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path());
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());
  ASSERT_TRUE(trainer.ForwardBackward(1, &loss).ok());

  Result<ChunkView> view = engine->Acquire(kLayers - 1);
  EXPECT_EQ(view.status().code(), StatusCode::kFailedPrecondition) << view.status().ToString();
  EXPECT_TRUE(Mentions(view.status(), "chunk " + std::to_string(kLayers - 1)))
      << view.status().ToString();
  std::vector<float> master(engine->layout().location(0).numel);
  Status read = engine->ReadMasterParameter(0, master);
  EXPECT_EQ(read.code(), StatusCode::kFailedPrecondition) << read.ToString();

  ASSERT_TRUE(engine->Step().get().ok());
  ASSERT_TRUE(engine->Acquire(kLayers - 1).ok());
  engine->Release(kLayers - 1);
  EXPECT_TRUE(engine->ReadMasterParameter(0, master).ok());
}

// Defect 7: what a monitoring thread reads while steps run (ThreadSanitizer checks the rest).
TEST(EngineContractTest, LossScaleAndMetricsCanBeReadWhileStepsRun) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  EngineOptions options =
      MakeOptions({"fp16", Tier::kNvme, Tier::kDevice}, dir.path(), DType::kFp16);
  options.precision.hysteresis = 1;
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  std::atomic<bool> done{false};
  std::atomic<int> odd_scales{0};
  std::atomic<int> reads{0};
  std::thread reader([&] {
    while (!done.load()) {
      const double scale = engine->loss_scale();
      if (scale != 65536.0 && scale != 32768.0) ++odd_scales;
      const std::string page = engine->metrics().RenderPrometheus();
      if (page.find("strata_loss_scale") == std::string::npos) ++odd_scales;
      (void)engine->step_count();
      (void)engine->counters();
      (void)engine->tier_usage(Tier::kHost);
      ++reads;
    }
  });
  EngineTrainer trainer(*engine, model);
  for (int step = 0; step < 6; ++step) {
    double loss = 0.0;
    Result<StepReport> report = trainer.TrainStep(step, &loss, /*poison=*/step == 3);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->skipped, step == 3);
  }
  done = true;
  reader.join();
  EXPECT_GT(reads.load(), 0);
  EXPECT_EQ(odd_scales.load(), 0);
  EXPECT_EQ(engine->loss_scale(), 32768.0);
}

// Defect 8: a step's hyper-parameters are fixed at its first GradsReady; a learning rate set
// after backward (as a scheduler stepped before optimizer.step() would) applies to the next
// step, for every chunk alike, however far their updates have got.
TEST(EngineContractTest, ALearningRateSetAfterBackwardAppliesFromTheNextStep) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions({"nvme", Tier::kNvme, Tier::kDevice}, dir.path());
  // Slow state reads keep the later chunks' updates from starting before SetLearningRate.
  auto plan = std::make_shared<nvme::FaultPlan>();
  plan->Add({.kind = nvme::FaultKind::kDelay, .op = nvme::IoOp::kRead, .times = -1, .delay = 20ms});
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model, FaultyNvme(plan));
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  ReferenceTrainer reference(model, options);
  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());
  reference.TrainStep(0);

  ASSERT_TRUE(trainer.ForwardBackward(1, &loss).ok());
  engine->SetLearningRate(3e-2);
  ASSERT_TRUE(engine->Step().get().ok());
  reference.TrainStep(1);  // Still at the old rate.
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()))
      << "max |diff| " << MaxAbsDiff(trainer.MasterParameters(), reference.master());

  reference.SetLearningRate(3e-2);
  ASSERT_TRUE(trainer.TrainStep(2, &loss).ok());
  EXPECT_EQ(loss, reference.TrainStep(2));
  EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()));
}

// Defect 9: eviction waits for the trainer's queued work on its victim without holding the
// engine's lock, so that work may call into the engine (here: loss_scale()).
TEST(EngineContractTest, EvictionWaitsForTheTrainersWorkWithoutHoldingTheEngine) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions({"params_host", Tier::kHost, Tier::kHost}, dir.path());
  auto device = MakeDevice(2 * kSlotBytes);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());  // Records the order: prefetch evicts now.

  auto forward = std::async(std::launch::async, [&]() -> Status {
    for (size_t c = 0; c < engine->chunk_count(); ++c) {
      STRATA_RETURN_IF_ERROR(engine->Acquire(c).status());
      STRATA_RETURN_IF_ERROR(device->LaunchHostFunction(Stream::kCompute, [&] {
        std::this_thread::sleep_for(20ms);
        (void)engine->loss_scale();
      }));
      engine->Release(c);
    }
    return device->SynchronizeStream(Stream::kCompute);
  });
  if (forward.wait_for(30s) != std::future_status::ready) {
    std::fprintf(stderr, "deadlock: eviction waits for work that waits for the engine\n");
    std::_Exit(1);
  }
  ASSERT_TRUE(forward.get().ok());
  EXPECT_GT(engine->counters().evictions, 0u);
  ASSERT_TRUE(trainer.TrainStep(1, &loss).ok());
}

// Defect 9: a fetch uploads the parameters and a zeroed gradient buffer; both are counted.
TEST(EngineContractTest, FetchesCountEveryByteTheyUpload) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions({"params_host", Tier::kHost, Tier::kHost}, dir.path());
  auto device = MakeDevice(2 * kSlotBytes);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  for (int step = 0; step < 2; ++step) ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
  const EngineCounters counters = engine->counters();
  const uint64_t chunk_bytes = engine->layout().chunk(0).numel * sizeof(float);
  EXPECT_GT(counters.fetches, 0u);
  // Host-home parameters reach the device only through fetches.
  EXPECT_EQ(counters.host_to_device_bytes, counters.fetches * 2 * chunk_bytes);
}

// A fetch reuses the device memory of a copy evicted or dropped before it, where the sizes
// match: allocating per fetch costs a cudaMalloc and a cudaFree (which waits for the whole
// device) on a GPU, and on HostDevice a fresh mapping whose every page faults on first touch.
TEST(EngineContractTest, FetchesReuseTheDeviceMemoryOfEvictedChunks) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions({"params_host", Tier::kHost, Tier::kHost}, dir.path());
  auto inner = MakeDevice(2 * kSlotBytes);
  WrappedDevice device(*inner);
  auto engine = MakeEngine(options, device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());
  const int allocations = device.allocations();
  const uint64_t fetches = engine->counters().fetches;
  for (int step = 1; step < 3; ++step) ASSERT_TRUE(trainer.TrainStep(step, &loss).ok());
  EXPECT_GT(engine->counters().fetches, fetches + 2 * engine->chunk_count());
  EXPECT_EQ(device.allocations(), allocations);
  // What the device holds stays within its budget, spare copies included.
  EXPECT_LE(device.memory_info().peak_bytes, 2 * kSlotBytes);
}

// Defect 9: destroying an engine whose updates were started by backward waits for them (under
// AddressSanitizer, a state read landing in a freed staging buffer would be caught), and for
// the gated journeys that wait for a verdict that never comes.
TEST(EngineContractTest, DestroyingAnEngineMidStepWaitsForItsWork) {
  for (double clipping : {0.0, 1.0}) {
    ScratchDir dir;
    const TinyModel model(kLayers, kWidth, kBatch);
    EngineOptions options = MakeOptions({"nvme", Tier::kNvme, Tier::kDevice}, dir.path());
    options.optimizer.gradient_clipping = clipping;
    auto plan = std::make_shared<nvme::FaultPlan>();
    plan->Add(
        {.kind = nvme::FaultKind::kDelay, .op = nvme::IoOp::kRead, .times = -1, .delay = 10ms});
    auto device = MakeDevice(64 << 20);
    auto engine = MakeEngine(options, *device, model, FaultyNvme(plan));
    ASSERT_NE(engine, nullptr);
    // Backward of half the chunks only: with clipping, their journeys wait for the rest.
    for (size_t c = engine->chunk_count(); c-- > engine->chunk_count() / 2;) {
      ASSERT_TRUE(engine->Acquire(c).ok());
      ASSERT_TRUE(engine->GradsReady(c).ok());
      engine->Release(c);
    }
    engine.reset();
    EXPECT_EQ(device->memory_info().used_bytes, 0u) << "clipping " << clipping;
  }
}

// Defect 10: a dynamic scale at its minimum that still overflows ends the step with an error
// (DeepSpeed raises "Current loss scale already at minimum"); the iteration still counts.
TEST(EngineContractTest, AnOverflowAtTheMinimumLossScaleIsAnError) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  EngineOptions options =
      MakeOptions({"fp16", Tier::kHost, Tier::kDevice}, dir.path(), DType::kFp16);
  options.precision.initial_scale_power = 1;  // 2, then 1 = the minimum.
  options.precision.hysteresis = 1;
  options.precision.min_loss_scale = 1.0;
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  Result<StepReport> first = trainer.TrainStep(0, &loss, /*poison=*/true);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_TRUE(first->skipped);
  EXPECT_EQ(first->iteration, 1);
  EXPECT_EQ(engine->loss_scale(), 1.0);

  Result<StepReport> stuck = trainer.TrainStep(1, &loss, /*poison=*/true);
  ASSERT_FALSE(stuck.ok());
  EXPECT_EQ(stuck.status().code(), StatusCode::kFailedPrecondition) << stuck.status().ToString();
  EXPECT_TRUE(Mentions(stuck.status(), "minimum")) << stuck.status().ToString();
  EXPECT_EQ(engine->iteration_count(), 2);
  EXPECT_EQ(engine->step_count(), 0);

  // The overflowing gradients are gone: the trainer may go on with clean ones.
  Result<StepReport> clean = trainer.TrainStep(2, &loss);
  ASSERT_TRUE(clean.ok()) << clean.status().ToString();
  EXPECT_FALSE(clean->skipped);
  EXPECT_EQ(clean->step, 1);
  EXPECT_EQ(clean->iteration, 3);
}

// --- Found by reading the engine as a trainer author would ---

// A chunk that sits a step out keeps no staging buffer: with one optimizer buffer, an unused
// last chunk (whose states would be read ahead first) must not starve the others' updates.
TEST(EngineContractTest, AChunkThatSitsAStepOutHoldsNoStagingBuffer) {
  for (int buffers : {1, 2}) {
    ScratchDir dir;
    const TinyModel model(kLayers, kWidth, kBatch);
    EngineOptions options = MakeOptions({"nvme", Tier::kNvme, Tier::kDevice}, dir.path());
    options.host.optimizer_buffer_count = buffers;
    auto device = MakeDevice(64 << 20);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    ReferenceTrainer reference(model, options);
    std::vector<bool> unused_chunks(kLayers, false);
    unused_chunks[kLayers - 1] = unused_chunks[kLayers - 2] = true;
    std::vector<bool> unused_params(model.parameter_count(), false);
    for (size_t p = 2 * (kLayers - 2); p < model.parameter_count(); ++p) unused_params[p] = true;
    trainer.SetUnusedChunks(unused_chunks);
    auto steps = std::async(std::launch::async, [&]() -> Status {
      for (int step = 0; step < 3; ++step) {
        double loss = 0.0;
        STRATA_RETURN_IF_ERROR(trainer.TrainStep(step, &loss).status());
        reference.TrainStep(step, /*skip=*/false, unused_params);
      }
      return Status();
    });
    if (steps.wait_for(30s) != std::future_status::ready) {
      std::fprintf(stderr, "hang: updates wait for a staging buffer an unused chunk holds\n");
      std::_Exit(1);
    }
    ASSERT_TRUE(steps.get().ok()) << "buffers " << buffers;
    EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master())) << "buffers " << buffers;
    // Save and Load drop and restart read-ahead: nothing may wait for a buffer there either.
    ASSERT_TRUE(engine->Save(dir.path() / "ckpt").ok());
    ASSERT_TRUE(engine->Load(dir.path() / "ckpt").ok());
  }
}

// An engine destroyed right after Step() (the future dropped, say while unwinding) finishes the
// step first, as its destructor promises.
TEST(EngineContractTest, DestroyingAnEngineRightAfterStepFinishesTheStep) {
  for (Tier states : {Tier::kHost, Tier::kNvme}) {
    ScratchDir dir;
    const TinyModel model(kLayers, kWidth, kBatch);
    const EngineOptions options = MakeOptions({"step", states, Tier::kDevice}, dir.path());
    auto device = MakeDevice(64 << 20);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    double loss = 0.0;
    ASSERT_TRUE(trainer.ForwardBackward(0, &loss).ok());
    std::this_thread::sleep_for(20ms);  // The updates that backward started have finished.
    std::future<Result<StepReport>> step = engine->Step();
    engine.reset();
    ASSERT_EQ(step.wait_for(0s), std::future_status::ready) << TierName(states);
    Result<StepReport> report = step.get();
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->step, 1);
  }
}

// Load and WriteParameterState rewrite device memory only after the trainer's queued work on
// it has run (a kernel still reading the old weights sees only the old weights).
TEST_P(ContractOnDeviceTest, LoadAndStateWritesWaitForTheTrainersQueuedWork) {
  for (bool load : {true, false}) {
    ScratchDir dir;
    const TinyModel model(kLayers, kWidth, kBatch);
    const EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path());
    auto device = MakeDevice(64 << 20);
    ASSERT_NE(device, nullptr);
    auto engine = MakeEngine(options, *device, model);
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    double loss = 0.0;
    ASSERT_TRUE(engine->Save(dir.path() / "ckpt").ok());
    ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());

    Result<ChunkView> view = engine->Acquire(0);
    ASSERT_TRUE(view.ok());
    QueuedRead kernel(*device, *view);
    ASSERT_TRUE(kernel.Queue().ok());
    engine->Release(0);
    if (load) {
      ASSERT_TRUE(engine->Load(dir.path() / "ckpt").ok());
    } else {
      std::vector<float> zeros(engine->layout().location(0).numel, 0.0f);
      ASSERT_TRUE(engine->WriteParameterState(0, ParameterState::kMaster, zeros).ok());
    }
    ASSERT_TRUE(device->SynchronizeStream(Stream::kCompute).ok());
    EXPECT_TRUE(kernel.SawTheOldWeights()) << (load ? "Load" : "write");
    EXPECT_FALSE(kernel.WeightsUnchanged()) << "nothing was replaced";
  }
}

// Each micro-step's backward writes into a gradient buffer that the previous micro-step's copy
// may still be reading; only Acquire waits for that, so GradsReady twice under one Acquire is
// refused rather than silently racing.
TEST(EngineContractTest, EachMicroStepNeedsItsOwnAcquire) {
  ScratchDir dir;
  const TinyModel model(2, kWidth, kBatch);
  EngineOptions options = MakeOptions({"host", Tier::kHost, Tier::kDevice}, dir.path());
  options.optimizer.gradient_accumulation_steps = 2;
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->Acquire(1).ok());
  ASSERT_TRUE(engine->GradsReady(1).ok());
  Status twice = engine->GradsReady(1);
  EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition) << twice.ToString();
  EXPECT_TRUE(Mentions(twice, "acquire the chunk again")) << twice.ToString();
  engine->Release(1);
  ASSERT_TRUE(engine->Acquire(1).ok());
  EXPECT_TRUE(engine->GradsReady(1).ok());
  engine->Release(1);
}

// The device's optimizer rewrites a device-kept chunk's parameters only after the trainer's
// work on it, even when that work runs on the trainer's own stream and the chunk is released
// after its gradients.
TEST(EngineContractTest, DeviceUpdatesWaitForTheTrainersUseOnItsOwnStream) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions({"device", Tier::kDevice, Tier::kDevice}, dir.path());
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model);
  ASSERT_NE(engine, nullptr);
  HostStream trainer_stream;
  const TrainerStream on{trainer_stream.native()};
  EngineTrainer trainer(*engine, model);
  double loss = 0.0;
  ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());

  // The last chunk of backward: no later GradsReady queues anything behind the trainer's read.
  const size_t c = 0;
  for (size_t i = engine->chunk_count(); i-- > 0;) {
    Result<ChunkView> view = engine->Acquire(i);
    ASSERT_TRUE(view.ok());
    ASSERT_TRUE(engine->GradsReady(i, on).ok());
    if (i == c) {
      // The trainer's input-gradient kernel reads the weights after GradsReady.
      const size_t bytes = view->numel * sizeof(float);
      auto expected = std::make_shared<std::vector<std::byte>>(bytes);
      auto seen = std::make_shared<std::vector<std::byte>>(bytes);
      std::memcpy(expected->data(), view->params, bytes);
      trainer_stream.Enqueue([expected, seen, bytes, params = view->params] {
        std::this_thread::sleep_for(100ms);
        std::memcpy(seen->data(), params, bytes);
        EXPECT_EQ(std::memcmp(seen->data(), expected->data(), bytes), 0)
            << "the update overwrote the weights a kernel was reading";
      });
    }
    engine->Release(i, on);
  }
  ASSERT_TRUE(engine->Step().get().ok());
  trainer_stream.Synchronize();
}

// After a failed step, only Step() (the retry) is accepted: gradients of a chunk that sat the
// failed attempt out would join a step whose norm was taken without them.
TEST(EngineContractTest, AfterAFailedStepOnlyTheRetryIsAccepted) {
  ScratchDir dir;
  const TinyModel model(kLayers, kWidth, kBatch);
  const EngineOptions options = MakeOptions({"nvme", Tier::kNvme, Tier::kDevice}, dir.path());
  auto plan = std::make_shared<nvme::FaultPlan>();
  auto device = MakeDevice(64 << 20);
  auto engine = MakeEngine(options, *device, model, FaultyNvme(plan));
  ASSERT_NE(engine, nullptr);
  EngineTrainer trainer(*engine, model);
  std::vector<bool> unused(kLayers, false);
  unused[0] = true;
  trainer.SetUnusedChunks(unused);
  plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kWrite, .error = EIO});
  double loss = 0.0;
  ASSERT_FALSE(trainer.TrainStep(0, &loss).ok());
  ASSERT_TRUE(engine->Acquire(0).ok());
  Status late = engine->GradsReady(0);
  EXPECT_EQ(late.code(), StatusCode::kFailedPrecondition) << late.ToString();
  EXPECT_TRUE(Mentions(late, "retry")) << late.ToString();
  engine->Release(0);
  Result<StepReport> retried = engine->Step().get();
  ASSERT_TRUE(retried.ok()) << retried.status().ToString();
  EXPECT_EQ(retried->step, 1);
}

// Device-kept states (offload_ratio < 1) read the trainer's gradient buffer itself, on any
// device. In a step that can fail after its updates (states on NVMe), their updates wait for the
// commit; when the step fails they still have to run, on this step's gradients, so the trainer
// may not Acquire those chunks (and write their gradients) before the retry.
TEST(EngineContractTest, AFailedStepKeepsDeviceKeptChunksForTheRetry) {
  for (const bool host_accessible : {false, true}) {
    SCOPED_TRACE(host_accessible ? "host-accessible device" : "copying device");
    ScratchDir dir;
    const TinyModel model(kLayers, kWidth, kBatch);
    const EngineOptions options =
        MakeOptions({"states_nvme_ratio_half", Tier::kNvme, Tier::kDevice, 0.5}, dir.path());
    auto plan = std::make_shared<nvme::FaultPlan>();
    auto device = MakeDevice(64 << 20, host_accessible);
    auto engine = MakeEngine(options, *device, model, FaultyNvme(plan));
    ASSERT_NE(engine, nullptr);
    EngineTrainer trainer(*engine, model);
    ReferenceTrainer reference(model, options);
    double loss = 0.0;
    ASSERT_TRUE(trainer.TrainStep(0, &loss).ok());
    reference.TrainStep(0);
    plan->Add({.kind = nvme::FaultKind::kError, .op = nvme::IoOp::kWrite, .error = EIO});
    ASSERT_TRUE(trainer.ForwardBackward(1, &loss).ok());
    ASSERT_FALSE(engine->Step().get().ok());

    // Backward of something else into every gradient buffer the trainer may still write.
    size_t refused = 0;
    for (size_t c = 0; c < engine->chunk_count(); ++c) {
      Result<ChunkView> view = engine->Acquire(c);
      if (!view.ok()) {
        EXPECT_EQ(view.status().code(), StatusCode::kFailedPrecondition)
            << view.status().ToString();
        EXPECT_NE(view.status().message().find("retry"), std::string::npos)
            << view.status().ToString();
        EXPECT_EQ(engine->placement(c).optimizer_states, Tier::kDevice) << "chunk " << c;
        ++refused;
        continue;
      }
      float* grads = static_cast<float*>(view->grads);
      std::fill(grads, grads + view->numel, 7.0f);
      engine->Release(c);
    }
    EXPECT_GT(refused, 0u) << "the device keeps some chunks' states";
    Result<StepReport> retried = engine->Step().get();
    ASSERT_TRUE(retried.ok()) << retried.status().ToString();
    reference.TrainStep(1);
    EXPECT_TRUE(BitEqual(trainer.MasterParameters(), reference.master()))
        << "max |diff| " << MaxAbsDiff(trainer.MasterParameters(), reference.master());
    // Once retried, every chunk is the trainer's again.
    ASSERT_TRUE(trainer.TrainStep(2, &loss).ok());
    EXPECT_EQ(loss, reference.TrainStep(2));
  }
}

}  // namespace
}  // namespace strata::offload
