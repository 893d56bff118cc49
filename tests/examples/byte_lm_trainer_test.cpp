// The built-in model trained through the offload engine: the shipped corpus, a falling loss, and
// a checkpoint/resume that continues bit-exactly.
#include "strata/examples/byte_lm_trainer.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <filesystem>

#include "strata/core/host_device.h"
#include "support/scratch_dir.h"
namespace strata::examples {
namespace {

using strata::testing::ScratchDir;

const Corpus& ShippedCorpus() {
  static const Corpus corpus = std::move(Corpus::Load(STRATA_CORPUS_PATH)).value();
  return corpus;
}

EngineOptions Options(Tier states, Tier params, const std::string& nvme_path) {
  EngineOptions o;
  o.placement.optimizer_states = states;
  o.placement.params = params;
  o.placement.chunk_bytes = 64 * 1024;
  o.nvme.paths = {nvme_path};
  o.optimizer.lr = 3e-3;
  o.optimizer.weight_decay = 0.0;
  o.optimizer.cpu_threads = 2;
  return o;
}

TrainSettings Tiny() {
  return {.model = {.context = 3, .width = 32, .layers = 2}, .batch = 4, .seq = 32, .seed = 5};
}

TEST(CorpusTest, ShippedCorpusSplitsAtALineAndHasTheDocumentedEntropy) {
  const Corpus& corpus = ShippedCorpus();
  const size_t total = corpus.train.size() + corpus.validation.size();
  EXPECT_EQ(total, 1893989u);  // examples/data/README.md
  EXPECT_EQ(corpus.train.size(), 1704443u);
  EXPECT_EQ(corpus.train.back(), '\n');
  // The README gives 3.0250 nats per byte over the whole text; the training split is close.
  EXPECT_NEAR(corpus.UnigramEntropy(), 3.025, 0.02);
}

TEST(CorpusTest, MissingOrTinyFilesAreClearErrors) {
  auto missing = Corpus::Load("/nonexistent/corpus.txt");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/corpus.txt"), std::string::npos);
  ScratchDir dir;
  const auto tiny = dir.path() / "tiny.txt";
  FILE* f = fopen(tiny.c_str(), "w");
  fputs("too short\n", f);
  fclose(f);
  EXPECT_EQ(Corpus::Load(tiny).status().code(), StatusCode::kInvalidArgument);
}

TEST(ByteLmTrainerTest, LossFallsWithOffloadedStateAndParameters) {
  ScratchDir dir;
  auto device = std::move(CreateHostDevice({.memory_budget_bytes = 1 << 20})).value();
  auto trainer =
      std::move(ByteLmTrainer::Create(Tiny(), Options(Tier::kNvme, Tier::kHost, dir.path()),
                                      *device, ShippedCorpus()))
          .value();
  const double before = *trainer->Evaluate();
  EXPECT_NEAR(before, std::log(256.0), 0.3);
  double first = 0.0, last = 0.0;
  for (int step = 0; step < 40; ++step) {
    auto record = trainer->TrainStep();
    ASSERT_TRUE(record.ok()) << record.status().ToString();
    EXPECT_EQ(record->step, step + 1);
    EXPECT_GT(record->counters.nvme_write_bytes, 0u);  // (Reads may come before the step.)
    if (step < 5) first += record->loss / 5;
    if (step >= 35) last += record->loss / 5;
  }
  EXPECT_LT(last, first - 0.5) << "first " << first << ", last " << last;
  // Parameters went back and forth: fetched to the device for every step.
  EXPECT_GE(trainer->engine().counters().fetches, 40u * trainer->engine().chunk_count());
  EXPECT_LT(*trainer->Evaluate(), before - 0.5);
}

TEST(ByteLmTrainerTest, ResumeFromACheckpointContinuesBitExactly) {
  ScratchDir dir;
  const EngineOptions options = Options(Tier::kHost, Tier::kDevice, dir.path());
  auto device = std::move(CreateHostDevice({.memory_budget_bytes = 64 << 20})).value();
  std::vector<double> straight;
  {
    auto trainer =
        std::move(ByteLmTrainer::Create(Tiny(), options, *device, ShippedCorpus())).value();
    for (int step = 0; step < 6; ++step) straight.push_back(trainer->TrainStep()->loss);
  }
  {
    auto trainer =
        std::move(ByteLmTrainer::Create(Tiny(), options, *device, ShippedCorpus())).value();
    for (int step = 0; step < 3; ++step) ASSERT_EQ(trainer->TrainStep()->loss, straight[step]);
    ASSERT_TRUE(trainer->engine().Save(dir.path() / "ckpt").ok());
  }
  // Resumed with its states on NVMe instead: the same losses.
  auto resumed =
      std::move(ByteLmTrainer::Create(Tiny(), Options(Tier::kNvme, Tier::kDevice, dir.path()),
                                      *device, ShippedCorpus()))
          .value();
  ASSERT_TRUE(resumed->engine().Load(dir.path() / "ckpt").ok());
  for (int step = 3; step < 6; ++step) {
    auto record = resumed->TrainStep();
    ASSERT_TRUE(record.ok());
    EXPECT_EQ(record->step, step + 1);
    EXPECT_EQ(record->loss, straight[step]) << "step " << step + 1;
  }
}

TEST(ByteLmTrainerTest, BadSettingsAreClearErrors) {
  auto device = std::move(CreateHostDevice()).value();
  TrainSettings settings = Tiny();
  settings.batch = 0;
  auto trainer = ByteLmTrainer::Create(settings, EngineOptions{}, *device, ShippedCorpus());
  EXPECT_EQ(trainer.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(trainer.status().message().find("--batch"), std::string::npos);
  settings = Tiny();
  settings.seq = 1 << 20;
  trainer = ByteLmTrainer::Create(settings, EngineOptions{}, *device, ShippedCorpus());
  EXPECT_EQ(trainer.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::examples
