// ReadEngineManifest: a manifest as Save writes it reads back, and each field that is missing,
// mistyped or out of range is DataLoss naming it, before Load touches anything.
#include "checkpoint/checkpoint_manifest.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace strata::offload::internal {
namespace {

using nlohmann::json;

/// The layout the fuzzer uses too (tests/fuzz/manifest_fuzzer.cpp): a trained 64x64 weight in
/// one chunk, a frozen bias in another.
ChunkLayout Layout() {
  std::vector<ParameterSpec> specs(2);
  specs[0].name = "w";
  specs[0].shape = {64, 64};
  specs[1].name = "b";
  specs[1].shape = {64};
  specs[1].frozen = true;
  return std::move(ChunkLayout::Build(specs, DType::kBf16, 8192)).value();
}

/// tests/fuzz/corpus/manifest/engine.json: what Save writes for Layout().
json Valid() {
  std::ifstream in(std::string(STRATA_SOURCE_DIR) + "/tests/fuzz/corpus/manifest/engine.json");
  return json::parse(in);
}

TEST(CheckpointManifestTest, ReadsWhatSaveWrites) {
  const ChunkLayout layout = Layout();
  ASSERT_EQ(layout.chunk_count(), 2u);
  Result<EngineManifest> read = ReadEngineManifest(Valid(), layout, OptimizerType::kAdamW);
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->step_count, 5);
  EXPECT_EQ(
      read->scaler,
      (LossScalerState{
          .scale = 65536.0, .iteration = 5, .last_overflow_iteration = 2, .hysteresis_left = 2}));
  EXPECT_EQ(read->world_size, 1);
  ASSERT_EQ(read->chunks.size(), 2u);
  EXPECT_TRUE(read->chunks[0].trained);
  EXPECT_EQ(read->chunks[0].files, (std::vector<FileDigest>{{49152, 1}}));
  EXPECT_EQ(read->chunks[0].names, (std::vector<std::string>{"chunk-000000.bin"}));
  EXPECT_FALSE(read->chunks[1].trained);
  EXPECT_EQ(read->chunks[1].files, (std::vector<FileDigest>{{4096, 2}}));
  EXPECT_EQ(read->chunk_steps, (std::vector<int64_t>{5, 0}));

  // Before per-chunk step counts every chunk took every step.
  json old = Valid();
  old["chunks"][0].erase("steps");
  EXPECT_EQ(ReadEngineManifest(old, layout, OptimizerType::kAdamW)->chunk_steps,
            (std::vector<int64_t>{5, 0}));
  // A trained chunk saved frozen (values only) starts its moments afresh.
  json frozen_then = Valid();
  frozen_then["chunks"][0]["bytes"] = 4096 * 4;
  frozen_then["chunks"][0]["frozen"] = true;
  EXPECT_EQ(ReadEngineManifest(frozen_then, layout, OptimizerType::kAdamW)->chunk_steps,
            (std::vector<int64_t>{0, 0}));
}

/// tests/fuzz/corpus/manifest/sharded.json: what two ranks' Save writes for Layout().
json ValidSharded() {
  std::ifstream in(std::string(STRATA_SOURCE_DIR) + "/tests/fuzz/corpus/manifest/sharded.json");
  return json::parse(in);
}

// Saved by two ranks: each chunk padded for two (the frozen one to 2048 elements), the trained
// one in a file per rank; it reads for an engine of one rank (whose chunks pad less).
TEST(CheckpointManifestTest, ReadsWhatTwoRanksSaveIntoAnotherWorldSize) {
  Result<EngineManifest> read = ReadEngineManifest(ValidSharded(), Layout(), OptimizerType::kAdamW);
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->world_size, 2);
  ASSERT_EQ(read->chunks.size(), 2u);
  EXPECT_TRUE(read->chunks[0].trained);
  EXPECT_EQ(read->chunks[0].numel, 4096u);
  EXPECT_EQ(read->chunks[0].files, (std::vector<FileDigest>{{24576, 3}, {24576, 4}}));
  EXPECT_EQ(read->chunks[0].names,
            (std::vector<std::string>{"chunk-000000.rank-00000-of-00002.bin",
                                      "chunk-000000.rank-00001-of-00002.bin"}));
  EXPECT_FALSE(read->chunks[1].trained);
  EXPECT_EQ(read->chunks[1].numel, 2048u);
  EXPECT_EQ(read->chunk_steps, (std::vector<int64_t>{5, 0}));

  struct Case {
    std::function<void(json&)> edit;
    StatusCode code;
    std::string named;
  };
  const std::vector<Case> cases = {
      {[](json& m) { m["engine"]["world_size"] = 0; }, StatusCode::kDataLoss,
       "engine.world_size is 0"},
      {[](json& m) { m["engine"]["world_size"] = 3; }, StatusCode::kInvalidArgument,
       "chunk 0 has a different size"},
      {[](json& m) { m["chunks"][0]["shards"].erase(1); }, StatusCode::kDataLoss,
       "chunks[0].shards has 1 files; engine.world_size says 2"},
      {[](json& m) { m["chunks"][0]["shards"][1]["bytes"] = 49152; }, StatusCode::kDataLoss,
       "chunk-000000.rank-00001-of-00002.bin holds 49152 bytes; a shard of chunk 0 needs 24576"},
      {[](json& m) { m["chunks"][0]["shards"][0].erase("xxh3"); }, StatusCode::kDataLoss,
       "chunks[0].shards[0].xxh3 is missing"},
      {[](json& m) { m["chunks"][1]["numel"] = 1024; }, StatusCode::kInvalidArgument,
       "chunk 1 has a different size"},
      {[](json& m) { m["engine"].erase("world_size"); }, StatusCode::kDataLoss,
       "chunks[0].shards has 2 files; engine.world_size says 1"},
  };
  for (const Case& c : cases) {
    json manifest = ValidSharded();
    c.edit(manifest);
    Result<EngineManifest> bad = ReadEngineManifest(manifest, Layout(), OptimizerType::kAdamW);
    ASSERT_FALSE(bad.ok()) << manifest.dump();
    EXPECT_EQ(bad.status().code(), c.code) << bad.status().message();
    EXPECT_NE(bad.status().message().find(c.named), std::string::npos)
        << c.named << " not in: " << bad.status().message();
  }
}

TEST(CheckpointManifestTest, EachBadFieldIsDataLossNamingIt) {
  const ChunkLayout layout = Layout();
  struct Case {
    std::function<void(json&)> edit;
    std::string named;
  };
  const std::vector<Case> cases = {
      {[](json& m) { m["engine"].erase("step_count"); }, "step_count"},
      {[](json& m) { m["engine"]["step_count"] = 2.5; },
       "engine.step_count is 2.5, not an integer"},
      {[](json& m) { m["engine"]["step_count"] = -1; }, "engine.step_count is -1; a count"},
      {[](json& m) {
         m["engine"]["step_count"] = INT64_MAX;
         m["chunks"][0]["steps"] = INT64_MAX;
       },
       "engine.step_count is 9223372036854775807"},
      {[](json& m) { m["engine"]["working_dtype"] = "fp8"; }, "engine.working_dtype is \"fp8\""},
      {[](json& m) { m["engine"]["optimizer"] = "sgd"; }, "engine.optimizer is \"sgd\", not known"},
      {[](json& m) { m["engine"]["step_count"] = "5"; }, "step_count is \"5\", not an integer"},
      {[](json& m) { m["engine"]["loss_scaler"]["scale"] = 0.0; }, "engine.loss_scaler.scale"},
      {[](json& m) { m["engine"]["loss_scaler"]["scale"] = -2.0; }, "engine.loss_scaler.scale"},
      {[](json& m) { m["engine"]["loss_scaler"]["iteration"] = -3; },
       "loss_scaler.iteration is -3"},
      {[](json& m) { m["engine"]["loss_scaler"]["last_overflow_iteration"] = 9; },
       "last_overflow_iteration is 9"},
      {[](json& m) { m["engine"]["loss_scaler"]["hysteresis_left"] = 0; }, "hysteresis_left"},
      {[](json& m) { m["engine"]["loss_scaler"].erase("scale"); }, "scale"},
      {[](json& m) { m["chunks"][0]["steps"] = 6; }, "chunks[0].steps is 6"},
      {[](json& m) { m["chunks"][0]["steps"] = -1; }, "chunks[0].steps is -1"},
      {[](json& m) { m["engine"]["loss_scaler"]["iteration"] = INT64_MAX; }, "iteration is 9223"},
      {[](json& m) { m["chunks"][0]["steps"] = true; }, "chunks[0].steps is true, not an integer"},
      {[](json& m) { m["chunks"][0]["bytes"] = 100; }, "holds 100 bytes; chunk 0 needs 49152"},
      {[](json& m) { m["chunks"][1].erase("xxh3"); }, "chunks[1].xxh3 is missing"},
      {[](json& m) { m["chunks"][1]["xxh3"] = "abc"; }, "xxh3"},
      {[](json& m) { m["chunks"][1]["frozen"] = false; }, "chunks[1].frozen is false but"},
      {[](json& m) { m.erase("parameters"); }, "parameters"},
      {[](json& m) { m["parameters"][0]["shape"] = "64x64"; }, "parameters[0].shape is \"64x64\""},
      {[](json& m) { m["parameters"][1]["chunk"] = -1; },
       "parameters[1].chunk is -1, not an unsigned"},
      {[](json& m) { m["chunks"][0]["frozen"] = "no"; },
       "chunks[0].frozen is \"no\", not a boolean"},
  };
  for (const Case& c : cases) {
    json manifest = Valid();
    c.edit(manifest);
    Result<EngineManifest> read = ReadEngineManifest(manifest, layout, OptimizerType::kAdamW);
    ASSERT_FALSE(read.ok()) << manifest.dump();
    EXPECT_EQ(read.status().code(), StatusCode::kDataLoss) << read.status().message();
    EXPECT_NE(read.status().message().find(c.named), std::string::npos)
        << c.named << " not in: " << read.status().message();
  }
}

TEST(CheckpointManifestTest, MomentsOfAnotherKindOfOptimizerAreRefused) {
  const ChunkLayout layout = Layout();
  EXPECT_TRUE(ReadEngineManifest(Valid(), layout, OptimizerType::kAdam).ok());
  for (OptimizerType other : {OptimizerType::kLion, OptimizerType::kAdagrad}) {
    Result<EngineManifest> read = ReadEngineManifest(Valid(), layout, other);
    ASSERT_FALSE(read.ok());
    EXPECT_EQ(read.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(read.status().message().find("holds adamw's optimizer states and this engine runs " +
                                           std::string(OptimizerTypeName(other))),
              std::string::npos)
        << read.status().message();
  }
}

TEST(CheckpointManifestTest, AnotherModelIsInvalidArgumentSayingWhy) {
  const ChunkLayout layout = Layout();
  const std::vector<std::pair<std::function<void(json&)>, std::string>> cases = {
      {[](json& m) { m["parameters"][0]["name"] = "v"; }, "'w' in the engine but 'v'"},
      {[](json& m) {
         m["parameters"][0]["shape"] = {32, 128};
       },
       "has shape [32,128]"},
      {[](json& m) { m["parameters"].erase(1); }, "the checkpoint has 1 parameters"},
      {[](json& m) { m["parameters"][1]["chunk"] = 0; }, "frozen"},
      {[](json& m) { m["chunks"][1]["numel"] = 2048; }, "chunk 1 has a different size"},
  };
  for (const auto& [edit, named] : cases) {
    json manifest = Valid();
    edit(manifest);
    Result<EngineManifest> read = ReadEngineManifest(manifest, layout, OptimizerType::kAdamW);
    ASSERT_FALSE(read.ok()) << manifest.dump();
    EXPECT_EQ(read.status().code(), StatusCode::kInvalidArgument) << read.status().message();
    EXPECT_NE(read.status().message().find(named), std::string::npos)
        << named << " not in: " << read.status().message();
  }
}

}  // namespace
}  // namespace strata::offload::internal
