#include "strata/core/config.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "strata/core/input_file.h"
#include "strata/core/options.h"

namespace strata {
namespace {

// Expects `result` to be an error of `code` whose message contains every one of `parts`.
template <typename T>
void ExpectError(const Result<T>& result, StatusCode code, const std::vector<std::string>& parts) {
  ASSERT_FALSE(result.ok()) << "expected an error containing " << parts.front();
  EXPECT_EQ(result.status().code(), code) << result.status().ToString();
  for (const auto& part : parts) {
    EXPECT_NE(result.status().message().find(part), std::string::npos)
        << "message: " << result.status().message() << "\nmissing: " << part;
  }
}

void ExpectInvalid(const Status& status, const std::vector<std::string>& parts) {
  ASSERT_FALSE(status.ok()) << "expected an error containing " << parts.front();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  for (const auto& part : parts) {
    EXPECT_NE(status.message().find(part), std::string::npos)
        << "message: " << status.message() << "\nmissing: " << part;
  }
}

Result<LoadedConfig> ParseDeepSpeed(const std::string& text) {
  return ParseConfig(text, ConfigFormat::kDeepSpeed, "ds_config.json");
}

// A ZeRO-Infinity config in the shape DeepSpeed's documentation and examples use, with every
// key Strata maps set to a non-default value.
constexpr const char* kZeroInfinityConfig = R"json({
  "train_batch_size": 16,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 4,
  "gradient_clipping": 1.0,
  "steps_per_print": 10,
  "wall_clock_breakdown": false,
  "optimizer": {
    "type": "Adam",
    "params": {"lr": 3e-5, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 3e-7,
               "bias_correction": false}
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}
  },
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "initial_scale_power": 12,
    "loss_scale_window": 500,
    "hysteresis": 3,
    "min_loss_scale": 2
  },
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": true,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_prefetch_bucket_size": 1e7,
    "stage3_param_persistence_threshold": 1e5,
    "reduce_bucket_size": 1e7,
    "sub_group_size": 1e9,
    "offload_optimizer": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 6,
      "pipeline_read": true,
      "pipeline_write": true,
      "ratio": 1,
      "fast_init": false
    },
    "offload_param": {
      "device": "nvme",
      "nvme_path": "/local_nvme2",
      "pin_memory": true,
      "buffer_count": 7,
      "buffer_size": 2e8,
      "max_in_cpu": 3e9
    }
  },
  "aio": {
    "block_size": 262144,
    "queue_depth": 32,
    "thread_count": 2,
    "single_submit": true,
    "overlap_events": false,
    "use_gds": false
  }
})json";

// What HuggingFace's Trainer documentation ships as a ZeRO-2 offload config: "auto" everywhere
// the Trainer would fill a value in.
constexpr const char* kHuggingFaceZero2Config = R"json({
  "fp16": {
    "enabled": "auto",
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "bf16": {"enabled": "auto"},
  "optimizer": {
    "type": "AdamW",
    "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
  },
  "zero_optimization": {
    "stage": 2,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "allgather_partitions": true,
    "allgather_bucket_size": 2e8,
    "overlap_comm": true,
    "reduce_scatter": true,
    "reduce_bucket_size": "auto",
    "contiguous_gradients": true
  },
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "steps_per_print": 2000,
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
})json";

// --- Options and Validate -------------------------------------------------------------------

TEST(OptionsTest, DefaultsValidate) {
  EngineOptions options;
  EXPECT_TRUE(options.Validate().ok()) << options.Validate().ToString();
}

TEST(OptionsTest, DefaultsMatchDeepSpeedAndTorch) {
  EngineOptions o;
  EXPECT_EQ(o.nvme.block_size, 1048576u);
  EXPECT_EQ(o.nvme.queue_depth, 8);
  EXPECT_EQ(o.nvme.thread_count, 1);
  EXPECT_FALSE(o.nvme.single_submit);
  EXPECT_TRUE(o.nvme.overlap_events);
  EXPECT_TRUE(o.nvme.direct_io);
  EXPECT_FALSE(o.nvme.allow_buffered_fallback);
  EXPECT_TRUE(o.nvme.checksums);
  EXPECT_EQ(o.nvme.backend, NvmeBackend::kAuto);
  // DeepSpeed's 4, unless set: automatic (read ahead of backward, host_memory.h); docs/config.md.
  EXPECT_EQ(o.host.optimizer_buffer_count, 0);
  EXPECT_EQ(o.host.param_buffer_count, 5);
  EXPECT_EQ(o.host.buffer_size, 100'000'000u);
  EXPECT_EQ(o.optimizer.type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(o.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(o.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(o.optimizer.beta2, 0.999);
  EXPECT_DOUBLE_EQ(o.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(o.optimizer.weight_decay, 0.01);
  EXPECT_TRUE(o.optimizer.bias_correction);
  EXPECT_EQ(o.precision.initial_scale_power, 16);
  EXPECT_EQ(o.precision.loss_scale_window, 1000);
  EXPECT_EQ(o.precision.hysteresis, 2);
  EXPECT_DOUBLE_EQ(o.precision.min_loss_scale, 1.0);
  EXPECT_DOUBLE_EQ(o.precision.loss_scale, 0.0);
  EXPECT_DOUBLE_EQ(o.placement.offload_ratio, 1.0);
  EXPECT_EQ(o.placement.chunk_bytes, 64 * kMiB);
  EXPECT_EQ(o.device.host_device_memory_bytes, 2 * kGiB);
}

TEST(OptionsTest, ValidateNamesFieldValueAndReason) {
  struct Case {
    const char* name;
    void (*mutate)(EngineOptions&);
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"optimizer nvme without paths",
       [](EngineOptions& o) { o.placement.optimizer_states = Tier::kNvme; },
       {"placement.optimizer_states is \"nvme\" but nvme.paths is empty; set nvme.paths "
        "(DeepSpeed: offload_optimizer.nvme_path)"}},
      {"params nvme without paths",
       [](EngineOptions& o) { o.placement.params = Tier::kNvme; },
       {"placement.params is \"nvme\"", "nvme.paths is empty", "offload_param.nvme_path"}},
      {"states in host without states on nvme",
       [](EngineOptions& o) { o.placement.max_states_in_host = kMiB; },
       {"placement.max_states_in_host is set but placement.optimizer_states is \"host\""}},
      {"beta1 = 1",
       [](EngineOptions& o) { o.optimizer.beta1 = 1.0; },
       {"optimizer.beta1 is 1", "[0, 1)"}},
      {"beta2 < 0",
       [](EngineOptions& o) { o.optimizer.beta2 = -0.5; },
       {"optimizer.beta2 is -0.5", "[0, 1)"}},
      {"negative lr",
       [](EngineOptions& o) { o.optimizer.lr = -1e-3; },
       {"optimizer.lr is -0.001", ">= 0"}},
      {"eps zero", [](EngineOptions& o) { o.optimizer.eps = 0; }, {"optimizer.eps is 0", "> 0"}},
      {"negative weight decay",
       [](EngineOptions& o) { o.optimizer.weight_decay = -1; },
       {"optimizer.weight_decay is -1"}},
      {"accumulation 0",
       [](EngineOptions& o) { o.optimizer.gradient_accumulation_steps = 0; },
       {"optimizer.gradient_accumulation_steps is 0", ">= 1"}},
      {"block size",
       [](EngineOptions& o) { o.nvme.block_size = 1000; },
       {"nvme.block_size is 1000", "multiple of 4096", "aio.block_size"}},
      {"queue depth 0",
       [](EngineOptions& o) { o.nvme.queue_depth = 0; },
       {"nvme.queue_depth is 0", "aio.queue_depth"}},
      {"thread count 0",
       [](EngineOptions& o) { o.nvme.thread_count = 0; },
       {"nvme.thread_count is 0"}},
      {"optimizer staging buffers -1",
       [](EngineOptions& o) { o.host.optimizer_buffer_count = -1; },
       {"host.optimizer_buffer_count is -1", ">= 1", "0 for automatic"}},
      {"param staging buffers 0",
       [](EngineOptions& o) { o.host.param_buffer_count = 0; },
       {"host.param_buffer_count is 0"}},
      {"tiny staging buffer",
       [](EngineOptions& o) { o.host.buffer_size = 100; },
       {"host.buffer_size is 100", "4096"}},
      {"pinned budget below one buffer",
       [](EngineOptions& o) { o.host.pinned_memory_bytes = 4096; },
       {"host.pinned_memory_bytes is 4096", "host.buffer_size"}},
      {"ratio above 1",
       [](EngineOptions& o) { o.placement.offload_ratio = 1.5; },
       {"placement.offload_ratio is 1.5", "[0, 1]", "offload_optimizer.ratio"}},
      {"ratio below 0",
       [](EngineOptions& o) { o.placement.offload_ratio = -0.1; },
       {"placement.offload_ratio is -0.1"}},
      {"zero stage 4",
       [](EngineOptions& o) { o.placement.zero_stage = 4; },
       {"placement.zero_stage is 4"}},
      {"chunk bytes",
       [](EngineOptions& o) { o.placement.chunk_bytes = 12345; },
       {"placement.chunk_bytes is 12345"}},
      {"prefetch depth",
       [](EngineOptions& o) { o.placement.prefetch_depth = -1; },
       {"placement.prefetch_depth is -1"}},
      {"collective timeout 0",
       [](EngineOptions& o) { o.placement.collective_timeout_seconds = 0; },
       {"placement.collective_timeout_seconds is 0"}},
      {"quantized gradients without stage 3",
       [](EngineOptions& o) { o.placement.quantized_gradients = true; },
       {"placement.quantized_gradients quantizes the gradient reduction of ZeRO stage 3",
        "zero_optimization.zero_quantized_gradients"}},
      {"quantized gradient width",
       [](EngineOptions& o) { o.placement.quantized_gradient_bits = 16; },
       {"placement.quantized_gradient_bits is 16", "8 (int8) or 4 (int4)"}},
      {"quantized weights without stage 3",
       [](EngineOptions& o) { o.placement.quantized_weights = true; },
       {"placement.quantized_weights quantizes the parameter all-gathers of ZeRO stage 3",
        "placement.zero_stage is 2", "zero_optimization.zero_quantized_weights"}},
      {"host device budget 0",
       [](EngineOptions& o) { o.device.host_device_memory_bytes = 0; },
       {"device.host_device_memory_bytes is 0"}},
      {"negative throttle",
       [](EngineOptions& o) { o.device.copy_bandwidth_gbps = -2; },
       {"device.copy_bandwidth_gbps is -2"}},
      {"cuda device -1",
       [](EngineOptions& o) { o.device.cuda_device = -1; },
       {"device.cuda_device is -1"}},
      {"empty nvme path", [](EngineOptions& o) { o.nvme.paths = {""}; }, {"nvme.paths[0]"}},
      {"duplicate nvme path",
       [](EngineOptions& o) {
         o.nvme.paths = {"/a", "/b", "/a"};
       },
       {"nvme.paths[2] is \"/a\"", "twice"}},
      {"initial scale power",
       [](EngineOptions& o) { o.precision.initial_scale_power = 200; },
       {"precision.initial_scale_power is 200"}},
      {"hysteresis 0",
       [](EngineOptions& o) { o.precision.hysteresis = 0; },
       {"precision.hysteresis is 0"}},
      {"min loss scale 0",
       [](EngineOptions& o) { o.precision.min_loss_scale = 0; },
       {"precision.min_loss_scale is 0"}},
      {"min loss scale above initial",
       [](EngineOptions& o) {
         o.precision.working_dtype = DType::kFp16;
         o.precision.initial_scale_power = 4;
         o.precision.min_loss_scale = 32;
       },
       {"precision.min_loss_scale is 32", "2^4"}},
      {"bad tier value",
       [](EngineOptions& o) { o.placement.params = static_cast<Tier>(9); },
       {"placement.params is 9"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    EngineOptions options;
    c.mutate(options);
    ExpectInvalid(options.Validate(), c.parts);
  }
}

TEST(OptionsTest, NvmePlacementWithPathsValidates) {
  // (Assignments, not designated initializers: g++ 12's -Wextra warns about the omitted
  // fields of a designated initializer even when they have default member initializers.)
  EngineOptions options;
  options.nvme.paths = {"/mnt/nvme0", "/mnt/nvme1"};
  options.placement.zero_stage = 3;
  options.placement.optimizer_states = Tier::kNvme;
  options.placement.params = Tier::kNvme;
  EXPECT_TRUE(options.Validate().ok()) << options.Validate().ToString();
}

TEST(OptionsTest, EnumNamesParseBack) {
  for (DeviceKind k : {DeviceKind::kHost, DeviceKind::kCuda}) {
    EXPECT_EQ(*ParseDeviceKind(DeviceKindName(k)), k);
  }
  for (NvmeBackend b : {NvmeBackend::kAuto, NvmeBackend::kIoUring, NvmeBackend::kPosix}) {
    EXPECT_EQ(*ParseNvmeBackend(NvmeBackendName(b)), b);
  }
  for (OptimizerType t : {OptimizerType::kAdamW, OptimizerType::kAdam, OptimizerType::kAdagrad,
                          OptimizerType::kLion}) {
    EXPECT_EQ(*ParseOptimizerType(OptimizerTypeName(t)), t);
  }
  EXPECT_EQ(*ParseOptimizerType("AdamW"), OptimizerType::kAdamW);
  EXPECT_FALSE(ParseOptimizerType("lamb").ok());
  EXPECT_FALSE(ParseNvmeBackend("aio").ok());
  EXPECT_FALSE(ParseDeviceKind("tpu").ok());
}

// --- Strata's format ------------------------------------------------------------------------

EngineOptions NonDefaultOptions() {
  EngineOptions o;
  o.device = {.kind = DeviceKind::kCuda,
              .host_device_memory_bytes = 3 * kGiB,
              .cuda_memory_bytes = 40 * kGiB,
              .copy_bandwidth_gbps = 12.5,
              .cuda_device = 1};
  o.host = {.pinned_memory_bytes = 100'000'000'000ULL,  // not a whole number of GiB
            .pin_memory = true,
            .optimizer_buffer_count = 6,
            .param_buffer_count = 9,
            .buffer_size = 200'000'000};
  o.nvme = {.paths = {"/mnt/nvme0/strata", "/mnt/nvme1/strata"},
            .block_size = 512 * kKiB,
            .queue_depth = 64,
            .thread_count = 4,
            .single_submit = true,
            .overlap_events = false,
            .direct_io = false,
            .allow_buffered_fallback = true,
            .checksums = false,
            .backend = NvmeBackend::kPosix};
  o.optimizer = {.type = OptimizerType::kLion,
                 .lr = 3.0e-5,
                 .beta1 = 0.95,
                 .beta2 = 0.98,
                 .eps = 1e-6,
                 .weight_decay = 0.1,
                 .bias_correction = false,
                 .gradient_clipping = 1.0,
                 .speculative_updates = false,
                 .delayed_update = true,
                 .delayed_update_from_step = 7,
                 .gradient_accumulation_steps = 8,
                 .cpu_threads = 12};
  // A fixed scale: fp16's dynamic one and a delayed update do not go together.
  o.precision = {.working_dtype = DType::kFp16,
                 .loss_scale = 4096,
                 .initial_scale_power = 20,
                 .loss_scale_window = 500,
                 .hysteresis = 4,
                 .min_loss_scale = 0.25};
  o.placement = {.zero_stage = 3,
                 .optimizer_states = Tier::kNvme,
                 .offload_ratio = 1.0,  // < 1 needs params on the device: RoundTripOffloadRatio.
                 .params = Tier::kHost,
                 .max_params_in_host = 5 * kGiB,
                 .max_states_in_host = 3 * kGiB,
                 .pipeline_read = true,
                 .pipeline_write = true,
                 .chunk_bytes = 128 * kMiB,
                 .prefetch_depth = 4,
                 .collective_timeout_seconds = 90.5,
                 .quantized_weights = true,
                 .quantized_gradients = true,
                 .quantized_gradient_bits = 4};
  return o;
}

TEST(StrataConfigTest, RoundTripDefaults) {
  EngineOptions defaults;
  std::string json = OptionsToJson(defaults);
  Result<LoadedConfig> loaded = ParseConfig(json);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString() << "\n" << json;
  EXPECT_EQ(loaded->format, ConfigFormat::kStrata);
  EXPECT_TRUE(loaded->options == defaults) << json;
  EXPECT_TRUE(loaded->ignored_keys.empty());
  EXPECT_TRUE(loaded->auto_resolved.empty());
}

TEST(StrataConfigTest, RoundTripOffloadRatio) {
  EngineOptions original;
  original.placement.offload_ratio = 0.3;
  Result<LoadedConfig> loaded = ParseConfig(OptionsToJson(original));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_DOUBLE_EQ(loaded->options.placement.offload_ratio, 0.3);
  // DeepSpeed's partial offload, with the parameters on the GPU.
  loaded = ParseDeepSpeed(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "ratio": 0.75}}})");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_DOUBLE_EQ(loaded->options.placement.offload_ratio, 0.75);
  EXPECT_EQ(loaded->options.placement.params, Tier::kDevice);
}

TEST(StrataConfigTest, RoundTripEveryFieldChanged) {
  const EngineOptions original = NonDefaultOptions();
  ASSERT_TRUE(original.Validate().ok()) << original.Validate().ToString();
  // Every field differs from its default, so the round trip below covers every field.
  EngineOptions defaults;
  EXPECT_NE(original.device, defaults.device);
  EXPECT_NE(original.host, defaults.host);
  EXPECT_NE(original.nvme, defaults.nvme);
  EXPECT_NE(original.optimizer, defaults.optimizer);
  EXPECT_NE(original.precision, defaults.precision);
  EXPECT_NE(original.placement, defaults.placement);

  const std::string json = OptionsToJson(original);
  Result<LoadedConfig> loaded = ParseConfig(json, ConfigFormat::kAuto, "roundtrip.json");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString() << "\n" << json;
  EXPECT_EQ(loaded->format, ConfigFormat::kStrata);
  EXPECT_TRUE(loaded->options == original) << json;
  // And the text is stable.
  EXPECT_EQ(OptionsToJson(loaded->options), json);
}

TEST(StrataConfigTest, JsonIsReadable) {
  const std::string json = OptionsToJson(EngineOptions{});
  EXPECT_NE(json.find("\"chunk_bytes\": \"64MiB\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"block_size\": \"1MiB\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"optimizer_states\": \"host\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"working_dtype\": \"bf16\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"type\": \"adamw\""), std::string::npos) << json;
  // Sizes that are not a whole number of units stay exact numbers.
  EXPECT_NE(json.find("\"buffer_size\": 100000000"), std::string::npos) << json;
  // Sections in struct order.
  EXPECT_LT(json.find("\"device\""), json.find("\"host\""));
  EXPECT_LT(json.find("\"host\""), json.find("\"nvme\""));
  EXPECT_LT(json.find("\"precision\""), json.find("\"placement\""));
}

TEST(StrataConfigTest, PartialConfigKeepsDefaultsAndParsesUnits) {
  Result<LoadedConfig> loaded = ParseConfig(R"json({
    // Comments are allowed.
    "nvme": {"paths": "/mnt/nvme0", "block_size": "256KiB", "backend": "io_uring"},
    "placement": {"optimizer_states": "nvme", "params": "cpu", "chunk_bytes": "128 MiB",
                  "max_params_in_host": 1e9},
    "precision": {"working_dtype": "float16"},
    "device": {"kind": "cuda", "cuda_memory_bytes": "70GiB"},
    "optimizer": {"type": "Adam", "lr": 2e-4}
  })json");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const EngineOptions& o = loaded->options;
  EXPECT_EQ(loaded->format, ConfigFormat::kStrata);
  EXPECT_EQ(o.nvme.paths, std::vector<std::string>{"/mnt/nvme0"});
  EXPECT_EQ(o.nvme.block_size, 256 * kKiB);
  EXPECT_EQ(o.nvme.backend, NvmeBackend::kIoUring);
  EXPECT_EQ(o.placement.optimizer_states, Tier::kNvme);
  EXPECT_EQ(o.placement.params, Tier::kHost);
  EXPECT_EQ(o.placement.chunk_bytes, 128 * kMiB);
  EXPECT_EQ(o.placement.max_params_in_host, 1'000'000'000u);
  EXPECT_EQ(o.precision.working_dtype, DType::kFp16);
  EXPECT_EQ(o.device.kind, DeviceKind::kCuda);
  EXPECT_EQ(o.device.cuda_memory_bytes, 70 * kGiB);
  EXPECT_EQ(o.optimizer.type, OptimizerType::kAdam);
  EXPECT_DOUBLE_EQ(o.optimizer.lr, 2e-4);
  // Untouched fields keep their defaults.
  EXPECT_EQ(o.nvme.queue_depth, 8);
  EXPECT_EQ(o.host, HostOptions{});
  EXPECT_DOUBLE_EQ(o.optimizer.beta2, 0.999);
}

TEST(StrataConfigTest, EmptyDocumentIsDefaults) {
  Result<LoadedConfig> loaded = ParseConfig("{}");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->format, ConfigFormat::kStrata);
  EXPECT_TRUE(loaded->options == EngineOptions{});
}

TEST(StrataConfigTest, UnknownKeyIsAnErrorNamingItsPath) {
  ExpectError(ParseConfig(R"({"nvme": {"queue_dpeth": 16}})", ConfigFormat::kAuto, "strata.json"),
              StatusCode::kInvalidArgument,
              {"strata.json", "unknown key \"nvme.queue_dpeth\"", "queue_depth", "block_size"});
  ExpectError(
      ParseConfig(R"({"placement": {}, "scheduler": {"type": "WarmupLR"}})", ConfigFormat::kStrata),
      StatusCode::kInvalidArgument, {"unknown key \"scheduler\"", "placement"});
  // A DeepSpeed config forced to be read as Strata fails on its first DeepSpeed key.
  ExpectError(ParseConfig(kZeroInfinityConfig, ConfigFormat::kStrata), StatusCode::kInvalidArgument,
              {"unknown key \"train_batch_size\""});
}

TEST(StrataConfigTest, WrongTypesAndBadValues) {
  ExpectError(ParseConfig(R"({"nvme": {"queue_depth": "eight"}})"), StatusCode::kInvalidArgument,
              {"nvme.queue_depth: expected an integer, got \"eight\""});
  ExpectError(ParseConfig(R"({"nvme": {"queue_depth": 2.5}})"), StatusCode::kInvalidArgument,
              {"nvme.queue_depth: expected an integer, got 2.5"});
  ExpectError(ParseConfig(R"({"nvme": {"block_size": -4096}})"), StatusCode::kInvalidArgument,
              {"nvme.block_size: expected a byte size", "got -4096"});
  ExpectError(ParseConfig(R"({"placement": {"chunk_bytes": "64 MeB"}})"),
              StatusCode::kInvalidArgument, {"placement.chunk_bytes", "\"64 MeB\""});
  ExpectError(ParseConfig(R"({"host": {"pin_memory": "yes"}})"), StatusCode::kInvalidArgument,
              {"host.pin_memory: expected true or false, got \"yes\""});
  ExpectError(ParseConfig(R"({"placement": {"params": "ssd"}})"), StatusCode::kInvalidArgument,
              {"placement.params: expected one of \"device\", \"host\", \"nvme\", got \"ssd\""});
  ExpectError(ParseConfig(R"({"precision": {"working_dtype": "fp8"}})"),
              StatusCode::kInvalidArgument, {"precision.working_dtype", "\"fp8\""});
  ExpectError(ParseConfig(R"({"nvme": []})"), StatusCode::kInvalidArgument,
              {"nvme: expected an object, got []"});
  ExpectError(ParseConfig(R"({"nvme": {"paths": ["/a", 3]}})"), StatusCode::kInvalidArgument,
              {"nvme.paths: expected a directory or a list of directories"});
  // Values of the right type that Validate rejects, prefixed with the source.
  ExpectError(
      ParseConfig(R"({"placement": {"offload_ratio": 1.5}})", ConfigFormat::kAuto, "strata.json"),
      StatusCode::kInvalidArgument,
      {"strata.json: placement.offload_ratio is 1.5; it must be in [0, 1]"});
  ExpectError(ParseConfig(R"({"placement": {"optimizer_states": "nvme"}})"),
              StatusCode::kInvalidArgument,
              {"placement.optimizer_states is \"nvme\" but nvme.paths is empty"});
  ExpectError(ParseConfig(R"({"nvme": {"block_size": 1000}})"), StatusCode::kInvalidArgument,
              {"nvme.block_size is 1000", "multiple of 4096"});
  ExpectError(ParseConfig(R"({"optimizer": {"beta1": 1.0}})"), StatusCode::kInvalidArgument,
              {"optimizer.beta1 is 1", "[0, 1)"});
  // "auto" is DeepSpeed's; in Strata's format it is just a wrong value.
  ExpectError(ParseConfig(R"({"optimizer": {"lr": "auto"}})"), StatusCode::kInvalidArgument,
              {"optimizer.lr: expected a number, got \"auto\""});
}

// --- Common errors ----------------------------------------------------------------------------

TEST(ConfigTest, MalformedJsonGivesPositionAndSource) {
  Result<LoadedConfig> loaded =
      ParseConfig("{\n  \"nvme\": {\"queue_depth\": 8,}\n}", ConfigFormat::kAuto, "bad.json");
  ExpectError(loaded, StatusCode::kInvalidArgument,
              {"bad.json", "malformed JSON", "byte", "line 2", "column"});
  EXPECT_EQ(loaded.status().message().find("[json.exception"), std::string::npos);
  ExpectError(ParseConfig(""), StatusCode::kInvalidArgument, {"<string>", "malformed JSON"});
  ExpectError(ParseConfig("[1, 2]"), StatusCode::kInvalidArgument,
              {"expected a JSON object at the top level, got [1,2]"});
}

TEST(ConfigTest, DuplicateKeysAreRefusedWithTheirPath) {
  ExpectError(ParseDeepSpeed(R"({"zero_optimization": {"stage": 2, "stage": 3}})"),
              StatusCode::kInvalidArgument,
              {"ds_config.json: key \"zero_optimization.stage\" is given twice"});
  ExpectError(ParseConfig(R"({"nvme": {"queue_depth": 8}, "nvme": {"queue_depth": 16}})",
                          ConfigFormat::kAuto, "strata.json"),
              StatusCode::kInvalidArgument, {"strata.json: key \"nvme\" is given twice"});
  // The same key in two different objects, or in objects inside an array, is no duplicate.
  Result<LoadedConfig> fine = ParseDeepSpeed(R"({"fp16": {"enabled": false},
      "bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.99]}}})");
  EXPECT_TRUE(fine.ok()) << fine.status().ToString();
  ExpectError(ParseConfig(R"({"nvme": {"paths": ["/a", "/b"]}, "nvme": {}})"),
              StatusCode::kInvalidArgument, {"\"nvme\" is given twice"});
}

TEST(ConfigTest, NumbersBeyondADoubleAreMalformedInput) {
  ExpectError(ParseDeepSpeed(R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e400}}})"),
              StatusCode::kInvalidArgument,
              {"ds_config.json: malformed JSON", "1e400", "beyond the range"});
}

TEST(ConfigTest, FileNotFound) {
  Result<LoadedConfig> loaded = LoadConfigFile("/nonexistent/strata/ds_config.json");
  ExpectError(loaded, StatusCode::kNotFound, {"/nonexistent/strata/ds_config.json"});
}

// What is not a regular file is refused at once, naming what it is: reading a directory fails,
// a FIFO would block forever, /dev/zero would never end.
TEST(ConfigTest, WhatIsNotARegularFileIsRefusedNamingIt) {
  const std::string dir = ::testing::TempDir();
  ExpectError(LoadConfigFile(dir), StatusCode::kInvalidArgument, {dir, "it is a directory"});
  ExpectError(LoadConfigFile("/dev/zero"), StatusCode::kInvalidArgument,
              {"/dev/zero", "it is a character device"});
  const std::string fifo =
      ::testing::TempDir() + "strata_config_fifo_" + std::to_string(::getpid());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  ExpectError(LoadConfigFile(fifo), StatusCode::kInvalidArgument, {fifo, "it is a FIFO"});
  ::unlink(fifo.c_str());
}

// A config larger than any config is refused before it is read.
TEST(ConfigTest, AFileLargerThanTheLimitIsRefusedUnread) {
  const std::string path =
      ::testing::TempDir() + "strata_config_huge_" + std::to_string(::getpid()) + ".json";
  {
    std::ofstream out(path);
    out << "{}";
  }
  std::filesystem::resize_file(path, kConfigInput.max_bytes + 1);  // Sparse: no disk used.
  ExpectError(LoadConfigFile(path), StatusCode::kInvalidArgument, {path, "larger than"});
  std::filesystem::remove(path);
}

TEST(ConfigTest, LoadsFileAndNamesItInErrors) {
  const std::string path =
      ::testing::TempDir() + "strata_config_test_" + std::to_string(::getpid()) + ".json";
  {
    std::ofstream out(path);
    out << kZeroInfinityConfig;
  }
  Result<LoadedConfig> loaded = LoadConfigFile(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->format, ConfigFormat::kDeepSpeed);
  EXPECT_EQ(loaded->options.placement.zero_stage, 3);
  {
    std::ofstream out(path);
    out << R"({"zero_optimization": {"stage": 7}})";
  }
  ExpectError(LoadConfigFile(path), StatusCode::kInvalidArgument,
              {path + ": zero_optimization.stage: expected an integer in [0, 3], got 7"});
  std::remove(path.c_str());
}

TEST(ConfigTest, FormatNames) {
  EXPECT_EQ(ConfigFormatName(ConfigFormat::kAuto), "auto");
  EXPECT_EQ(ConfigFormatName(ConfigFormat::kStrata), "strata");
  EXPECT_EQ(ConfigFormatName(ConfigFormat::kDeepSpeed), "deepspeed");
}

// --- Format detection ------------------------------------------------------------------------

TEST(ConfigTest, DetectsFormat) {
  auto format_of = [](const std::string& text) {
    Result<LoadedConfig> loaded = ParseConfig(text);
    EXPECT_TRUE(loaded.ok()) << loaded.status().ToString();
    return loaded.ok() ? loaded->format : ConfigFormat::kAuto;
  };
  EXPECT_EQ(format_of(kZeroInfinityConfig), ConfigFormat::kDeepSpeed);
  EXPECT_EQ(format_of(kHuggingFaceZero2Config), ConfigFormat::kDeepSpeed);
  EXPECT_EQ(format_of(R"({"train_batch_size": 8})"), ConfigFormat::kDeepSpeed);
  EXPECT_EQ(format_of(R"({"nvme": {"paths": ["/x"]}})"), ConfigFormat::kStrata);
  // Only "optimizer": its shape decides.
  EXPECT_EQ(format_of(R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})"),
            ConfigFormat::kDeepSpeed);
  EXPECT_EQ(format_of(R"({"optimizer": {"type": "adamw", "lr": 1e-4}})"), ConfigFormat::kStrata);
  // Both kinds of keys: the optimizer's shape decides too, and the other format's section is
  // then an unknown key.
  ExpectError(ParseConfig(R"({"fp16": {"enabled": true}, "host": {},
                              "optimizer": {"type": "Adam", "params": {}}})"),
              StatusCode::kInvalidArgument,
              {"unknown key \"host\" in a DeepSpeed config", "section of Strata's own format"});
}

TEST(ConfigTest, MixedDocumentWithoutOptimizerIsAmbiguous) {
  ExpectError(ParseConfig(R"({"zero_optimization": {"stage": 2}, "nvme": {}})"),
              StatusCode::kInvalidArgument,
              {"cannot tell", "zero_optimization", "nvme", "ConfigFormat"});
  // An explicit format says which keys are foreign: a Strata section read as DeepSpeed (the
  // content of a Strata file under --format deepspeed) is refused, not ignored.
  ExpectError(ParseDeepSpeed(R"({"zero_optimization": {"stage": 2}, "nvme": {}})"),
              StatusCode::kInvalidArgument, {"unknown key \"nvme\"", "--format strata"});
}

// Typos and misplaced keys are errors, near misses with the key meant; known DeepSpeed keys
// that Strata does not use stay warnings.
TEST(DeepSpeedConfigTest, UnknownKeysAreRefusedWithTheLikelyKeyMeant) {
  ExpectError(
      ParseDeepSpeed(R"({"zero_optimization": {"stage": 2,
                  "offload_optimzer": {"device": "cpu"}}})"),
      StatusCode::kInvalidArgument,
      {"ds_config.json: unknown key \"zero_optimization.offload_optimzer\"",
       "did you mean \"zero_optimization.offload_optimizer\"?",
       "DeepSpeed refuses unknown keys in \"zero_optimization\" too", "Strata reads", "stage"});
  ExpectError(ParseDeepSpeed(R"({"zero_optimization": {"typo_stage": 3}})"),
              StatusCode::kInvalidArgument, {"unknown key \"zero_optimization.typo_stage\""});
  ExpectError(ParseDeepSpeed(R"({"zero_optimization": {"stage": 3,
                  "offload_optimzer": {"device": "cpu"},
                  "offload_param": {"device": "cpu", "pin_memory": true}}})"),
              StatusCode::kInvalidArgument,
              {"did you mean \"zero_optimization.offload_optimizer\"?"});  // Not the placement.
  ExpectError(ParseDeepSpeed(R"({"zero_optimization": {"stage": 3,
                  "offload_optimizer": {"device": "cpu"},
                  "offload_param": {"device": "cpu", "pin_memroy": true}}})"),
              StatusCode::kInvalidArgument,
              {"did you mean \"zero_optimization.offload_param.pin_memory\"?"});
  ExpectError(ParseDeepSpeed(R"({"zero_optimization": {"stage": 3, "aio": {"queue_depth": 8}}})"),
              StatusCode::kInvalidArgument,
              {"\"aio\" is a top-level section, not part of \"zero_optimization\""});
  ExpectError(ParseDeepSpeed(R"({"zero_optimisation": {"stage": 3}})"),
              StatusCode::kInvalidArgument,
              {"unknown key \"zero_optimisation\"", "did you mean \"zero_optimization\"?",
               "DeepSpeed would ignore it"});
  ExpectError(ParseDeepSpeed(R"({"fp16": {"enabled": true, "loss_scael": 0}})"),
              StatusCode::kInvalidArgument, {"did you mean \"fp16.loss_scale\"?"});
  // Known to DeepSpeed, unused by Strata: a warning, as before.
  Result<LoadedConfig> loaded = ParseDeepSpeed(R"({"zero_optimization": {"stage": 3,
      "stage3_max_live_parameters": 1e9, "overlap_comm": true},
      "fp16": {"enabled": true, "auto_cast": false}, "aio": {"use_gds": false, "io_backend": 1}})");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->ignored_keys,
            (std::vector<std::string>{"zero_optimization.stage3_max_live_parameters",
                                      "zero_optimization.overlap_comm", "fp16.auto_cast",
                                      "aio.use_gds", "aio.io_backend"}));
  // Strata's own format suggests too.
  ExpectError(ParseConfig(R"({"nvme": {"queue_dpeth": 16}})", ConfigFormat::kAuto, "s.json"),
              StatusCode::kInvalidArgument, {"did you mean \"nvme.queue_depth\"?"});
}

// --- DeepSpeed's format -------------------------------------------------------------------------

TEST(DeepSpeedConfigTest, ZeroInfinityMapsEveryKey) {
  Result<LoadedConfig> loaded = ParseConfig(kZeroInfinityConfig, ConfigFormat::kAuto, "ds.json");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->format, ConfigFormat::kDeepSpeed);
  const EngineOptions& o = loaded->options;

  // zero_optimization
  EXPECT_EQ(o.placement.zero_stage, 3);
  EXPECT_EQ(o.placement.optimizer_states, Tier::kNvme);
  EXPECT_EQ(o.placement.params, Tier::kNvme);
  EXPECT_EQ(o.nvme.paths, (std::vector<std::string>{"/local_nvme", "/local_nvme2"}));
  EXPECT_TRUE(o.host.pin_memory);
  EXPECT_EQ(o.host.optimizer_buffer_count, 6);
  EXPECT_EQ(o.host.param_buffer_count, 7);
  EXPECT_EQ(o.host.buffer_size, 400'000'000u);                // 2e8 fp16 elements
  EXPECT_EQ(o.placement.max_params_in_host, 6'000'000'000u);  // 3e9 fp16 elements
  EXPECT_TRUE(o.placement.pipeline_read);
  EXPECT_TRUE(o.placement.pipeline_write);
  EXPECT_DOUBLE_EQ(o.placement.offload_ratio, 1.0);  // < 1 needs offload_param none: below.
  // aio
  EXPECT_EQ(o.nvme.block_size, 262144u);
  EXPECT_EQ(o.nvme.queue_depth, 32);
  EXPECT_EQ(o.nvme.thread_count, 2);
  EXPECT_TRUE(o.nvme.single_submit);
  EXPECT_FALSE(o.nvme.overlap_events);
  // optimizer: DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
  EXPECT_EQ(o.optimizer.type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(o.optimizer.lr, 3e-5);
  EXPECT_DOUBLE_EQ(o.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(o.optimizer.beta2, 0.99);
  EXPECT_DOUBLE_EQ(o.optimizer.eps, 1e-6);
  EXPECT_DOUBLE_EQ(o.optimizer.weight_decay, 3e-7);
  EXPECT_FALSE(o.optimizer.bias_correction);
  EXPECT_DOUBLE_EQ(o.optimizer.gradient_clipping, 1.0);
  EXPECT_EQ(o.optimizer.gradient_accumulation_steps, 4);
  EXPECT_EQ(loaded->train_batch_size, 16);
  EXPECT_EQ(loaded->micro_batch_size, 4);
  // fp16
  EXPECT_EQ(o.precision.working_dtype, DType::kFp16);
  EXPECT_DOUBLE_EQ(o.precision.loss_scale, 0.0);
  EXPECT_EQ(o.precision.initial_scale_power, 12);
  EXPECT_EQ(o.precision.loss_scale_window, 500);
  EXPECT_EQ(o.precision.hysteresis, 3);
  EXPECT_DOUBLE_EQ(o.precision.min_loss_scale, 2.0);
  // Strata-only settings keep Strata's defaults.
  EXPECT_EQ(o.device, DeviceOptions{});
  EXPECT_TRUE(o.nvme.direct_io);
  EXPECT_TRUE(o.nvme.checksums);
  EXPECT_EQ(o.placement.chunk_bytes, 64 * kMiB);

  const std::vector<std::string> expected_ignored = {
      "steps_per_print",
      "wall_clock_breakdown",
      "scheduler",
      "zero_optimization.contiguous_gradients",
      "zero_optimization.stage3_max_live_parameters",
      "zero_optimization.stage3_max_reuse_distance",
      "zero_optimization.stage3_prefetch_bucket_size",
      "zero_optimization.stage3_param_persistence_threshold",
      "zero_optimization.reduce_bucket_size",
      "zero_optimization.sub_group_size",
      "zero_optimization.offload_optimizer.fast_init",
      "aio.use_gds",
  };
  EXPECT_EQ(loaded->ignored_keys, expected_ignored);
  EXPECT_TRUE(loaded->auto_resolved.empty());
}

// train_batch_size = micro batch x gradient_accumulation_steps x world size: the missing one
// is derived, as DeepSpeed derives it, and an inconsistent triple is refused.
TEST(DeepSpeedConfigTest, BatchSizesAreDerivedAndCheckedAsDeepSpeedDoes) {
  struct Case {
    const char* json;
    int world_size;
    int64_t train, micro;
    int accumulation;
  };
  const Case cases[] = {
      {R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3})", 1, 24, 3, 8},
      {R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3})", 2, 24, 3, 4},
      {R"({"train_batch_size": 24, "gradient_accumulation_steps": 4})", 2, 24, 3, 4},
      {R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4})", 2, 24, 3, 4},
      {R"({"train_batch_size": 24})", 4, 24, 6, 1},
      {R"({"train_micro_batch_size_per_gpu": 5})", 1, 5, 5, 1},
      {R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3,
           "gradient_accumulation_steps": 4})",
       2, 24, 3, 4},
      {R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
           "gradient_accumulation_steps": "auto"})",
       1, 2, 2, 1},
  };
  for (const Case& c : cases) {
    Result<LoadedConfig> loaded =
        ParseConfig(c.json, ConfigFormat::kDeepSpeed, "ds.json", c.world_size);
    ASSERT_TRUE(loaded.ok()) << c.json << ": " << loaded.status().ToString();
    EXPECT_EQ(loaded->train_batch_size, c.train) << c.json;
    EXPECT_EQ(loaded->micro_batch_size, c.micro) << c.json;
    EXPECT_EQ(loaded->options.optimizer.gradient_accumulation_steps, c.accumulation) << c.json;
  }
  // Only accumulation: the trainer picks the batch.
  Result<LoadedConfig> only = ParseDeepSpeed(R"({"gradient_accumulation_steps": 3})");
  ASSERT_TRUE(only.ok());
  EXPECT_FALSE(only->train_batch_size.has_value());
  EXPECT_EQ(only->options.optimizer.gradient_accumulation_steps, 3);
  // Inconsistent, or not divisible.
  ExpectError(ParseDeepSpeed(R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1,
                                 "gradient_accumulation_steps": 4})"),
              StatusCode::kInvalidArgument,
              {"ds_config.json: train_batch_size 16 is not", "(1 x 4 x 1)", "--world-size"});
  ExpectError(ParseDeepSpeed(R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})"),
              StatusCode::kInvalidArgument, {"train_batch_size 10 is not", "derived"});
  ExpectError(ParseConfig(R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1,
                              "gradient_accumulation_steps": 4})",
                          ConfigFormat::kDeepSpeed, "ds.json", 0),
              StatusCode::kInvalidArgument, {"world size 0"});
  EXPECT_TRUE(ParseConfig(R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1,
                              "gradient_accumulation_steps": 4})",
                          ConfigFormat::kDeepSpeed, "ds.json", 4)
                  .ok());
  // Products beyond 64 bits are inconsistent, not wrapped around into agreement.
  ExpectError(ParseConfig(R"({"train_micro_batch_size_per_gpu": 2147483647,
                              "gradient_accumulation_steps": 2147483647})",
                          ConfigFormat::kDeepSpeed, "ds.json", 4),
              StatusCode::kInvalidArgument, {"is not train_micro_batch_size_per_gpu"});
  ExpectError(ParseConfig(R"({"train_batch_size": 3145728, "train_micro_batch_size_per_gpu": 34669,
                              "gradient_accumulation_steps": 507432751})",
                          ConfigFormat::kDeepSpeed, "ds.json", 1 << 20),
              StatusCode::kInvalidArgument, {"train_batch_size 3145728 is not"});
}

TEST(ConfigTest, DeepNestingIsRefusedNotRecursedInto) {
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  ExpectError(ParseConfig(deep), StatusCode::kInvalidArgument, {"nested more than 64 levels"});
  ExpectError(ParseDeepSpeed(R"({"fp16": {"enabled": )" + std::string(100, '[') +
                             std::string(100, ']') + "}}"),
              StatusCode::kInvalidArgument, {"nested more than 64 levels"});
}

TEST(DeepSpeedConfigTest, TopLevelKeysOfCurrentDeepSpeedAreKnown) {
  Result<LoadedConfig> loaded = ParseDeepSpeed(R"({"seq_parallel_comm_data_type": "fp32",
      "sequence_parallel_size": 1, "vocabulary_size": 50304, "gradient_allreduce_op": "avg",
      "log_level": "info", "zero_optimization": {"stage": 1}})");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->ignored_keys.size(), 5u);
}

TEST(DeepSpeedConfigTest, IgnoredKeysWarningIsOneLine) {
  Result<LoadedConfig> loaded = ParseDeepSpeed(kHuggingFaceZero2Config);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const std::string warning = IgnoredKeysWarning(*loaded);
  EXPECT_EQ(warning,
            "DeepSpeed config keys not used by Strata (ignored): scheduler, "
            "zero_optimization.allgather_partitions, zero_optimization.allgather_bucket_size, "
            "zero_optimization.overlap_comm, zero_optimization.reduce_scatter, "
            "zero_optimization.reduce_bucket_size, zero_optimization.contiguous_gradients, "
            "steps_per_print, "
            "wall_clock_breakdown");
  EXPECT_EQ(warning.find('\n'), std::string::npos);

  Result<LoadedConfig> clean = ParseDeepSpeed(R"({"zero_optimization": {"stage": 1}})");
  ASSERT_TRUE(clean.ok()) << clean.status().ToString();
  EXPECT_EQ(IgnoredKeysWarning(*clean), "");
  // Strata's own format never has ignored keys.
  Result<LoadedConfig> strata = ParseConfig(OptionsToJson(EngineOptions{}));
  ASSERT_TRUE(strata.ok());
  EXPECT_EQ(IgnoredKeysWarning(*strata), "");
}

TEST(DeepSpeedConfigTest, AutoValuesResolveToDefaultsAndAreRecorded) {
  Result<LoadedConfig> loaded = ParseDeepSpeed(kHuggingFaceZero2Config);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const EngineOptions& o = loaded->options;
  EXPECT_EQ(o.placement.zero_stage, 2);
  EXPECT_EQ(o.placement.optimizer_states, Tier::kHost);
  EXPECT_EQ(o.placement.params, Tier::kDevice);
  EXPECT_TRUE(o.host.pin_memory);
  EXPECT_EQ(o.precision.working_dtype, DType::kFp32);
  EXPECT_EQ(o.optimizer.type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(o.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(o.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(o.optimizer.beta2, 0.999);
  EXPECT_DOUBLE_EQ(o.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(o.optimizer.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(o.optimizer.gradient_clipping, 0.0);
  EXPECT_EQ(o.optimizer.gradient_accumulation_steps, 1);
  const std::vector<std::string> expected = {
      "fp16.enabled: auto -> false",
      "bf16.enabled: auto -> false",
      "optimizer.params.lr: auto -> 0.001",
      "optimizer.params.betas: auto -> [0.9, 0.999]",
      "optimizer.params.eps: auto -> 1e-08",
      "optimizer.params.weight_decay: auto -> 0.0",
      "gradient_clipping: auto -> 0.0",
      // HuggingFace's Trainer fills these in; to Strata the trainer chooses the batch.
      "train_batch_size: auto -> the trainer's",
      "train_micro_batch_size_per_gpu: auto -> the trainer's",
      "gradient_accumulation_steps: auto -> 1",
  };
  EXPECT_EQ(loaded->auto_resolved, expected);
}

TEST(DeepSpeedConfigTest, AutoWorksForAnyMappedKey) {
  Result<LoadedConfig> loaded = ParseDeepSpeed(R"json({
    "zero_optimization": {
      "stage": "auto",
      "offload_optimizer": {"device": "auto", "buffer_count": "auto", "ratio": "auto"}
    },
    "aio": {"block_size": "auto", "queue_depth": "auto", "single_submit": "auto"},
    "optimizer": {"type": "auto"}
  })json");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->options.placement.zero_stage, 0);
  EXPECT_EQ(loaded->options.nvme.block_size, kMiB);
  EXPECT_EQ(loaded->options.optimizer.type, OptimizerType::kAdamW);
  const std::vector<std::string> expected = {
      "optimizer.type: auto -> \"AdamW\"", "zero_optimization.stage: auto -> 0",
      "aio.block_size: auto -> 1048576",   "aio.queue_depth: auto -> 8",
      "aio.single_submit: auto -> false",
  };
  EXPECT_EQ(loaded->auto_resolved, expected);
  // Stage 0 does not use offload_optimizer, so DeepSpeed ignores it and so does Strata.
  EXPECT_EQ(loaded->ignored_keys, std::vector<std::string>{"zero_optimization.offload_optimizer"});
}

// ZeRO++'s quantized weights act on stage 3's gathers only: read there, and elsewhere ignored
// with the warning, as DeepSpeed ignores it.
TEST(DeepSpeedConfigTest, ZeroQuantizedWeightsIsReadAtStageThree) {
  Result<LoadedConfig> loaded = ParseDeepSpeed(
      R"({"zero_optimization": {"stage": 3, "zero_quantized_weights": true,
          "zero_quantized_gradients": true,
          "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_TRUE(loaded->options.placement.quantized_weights);
  EXPECT_TRUE(loaded->options.placement.quantized_gradients);
  EXPECT_TRUE(loaded->ignored_keys.empty());
  loaded = ParseDeepSpeed(R"({"zero_optimization": {"stage": 2, "zero_quantized_weights": true}})");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_FALSE(loaded->options.placement.quantized_weights);
  EXPECT_EQ(loaded->ignored_keys,
            std::vector<std::string>{"zero_optimization.zero_quantized_weights"});
  loaded = ParseDeepSpeed(R"({"zero_optimization": {"stage": 3, "zero_quantized_weights": 1}})");
  EXPECT_FALSE(loaded.ok());
}

TEST(DeepSpeedConfigTest, AbsentKeysMeanWhatTheyMeanInDeepSpeed) {
  Result<LoadedConfig> loaded = ParseDeepSpeed(R"({"train_batch_size": 32})");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const EngineOptions& o = loaded->options;
  EXPECT_EQ(o.placement.zero_stage, 0);
  EXPECT_EQ(o.placement.optimizer_states, Tier::kDevice);
  EXPECT_EQ(o.placement.params, Tier::kDevice);
  EXPECT_EQ(o.precision.working_dtype, DType::kFp32);
  EXPECT_FALSE(o.host.pin_memory);
  EXPECT_EQ(o.host.buffer_size, 400'000'000u);  // 1e8 fp32 elements
  EXPECT_EQ(o.placement.max_params_in_host, 4'000'000'000u);
  // No "optimizer" section: the trainer's optimizer settings (Strata's defaults) stand.
  EXPECT_EQ(o.optimizer, OptimizerOptions{});
}

TEST(DeepSpeedConfigTest, AdamWModeAndOptimizerTypes) {
  auto optimizer_of = [](const std::string& optimizer_json) {
    Result<LoadedConfig> loaded = ParseDeepSpeed(R"({"optimizer": )" + optimizer_json + "}");
    EXPECT_TRUE(loaded.ok()) << loaded.status().ToString();
    return loaded.ok() ? loaded->options.optimizer : OptimizerOptions{};
  };
  EXPECT_EQ(optimizer_of(R"({"type": "Adam"})").type, OptimizerType::kAdamW);
  EXPECT_EQ(optimizer_of(R"({"type": "Adam", "params": {"adam_w_mode": true}})").type,
            OptimizerType::kAdamW);
  EXPECT_EQ(optimizer_of(R"({"type": "Adam", "params": {"adam_w_mode": false}})").type,
            OptimizerType::kAdam);
  EXPECT_EQ(optimizer_of(R"({"type": "AdamW", "params": {"adam_w_mode": false}})").type,
            OptimizerType::kAdamW);
  EXPECT_EQ(optimizer_of(R"({"type": "adamw"})").type, OptimizerType::kAdamW);
  OptimizerOptions adagrad = optimizer_of(R"({"type": "ADAGRAD"})");
  EXPECT_EQ(adagrad.type, OptimizerType::kAdagrad);
  EXPECT_DOUBLE_EQ(adagrad.lr, 1e-2);  // DeepSpeedCPUAdagrad's defaults
  EXPECT_DOUBLE_EQ(adagrad.eps, 1e-10);
  OptimizerOptions lion = optimizer_of(R"({"type": "Lion", "params": {"lr": 1e-4,
                                           "betas": [0.9, 0.99], "weight_decay": 0.1}})");
  EXPECT_EQ(lion.type, OptimizerType::kLion);
  EXPECT_DOUBLE_EQ(lion.lr, 1e-4);
  EXPECT_DOUBLE_EQ(lion.beta2, 0.99);
  EXPECT_DOUBLE_EQ(lion.weight_decay, 0.1);
  // DeepSpeed's weight_decay default is 0, not torch's 0.01.
  EXPECT_DOUBLE_EQ(optimizer_of(R"({"type": "AdamW", "params": {}})").weight_decay, 0.0);
}

TEST(DeepSpeedConfigTest, UnknownOptimizerListsSupportedOnes) {
  ExpectError(ParseDeepSpeed(R"({"optimizer": {"type": "OneBitLamb", "params": {}}})"),
              StatusCode::kInvalidArgument,
              {"ds_config.json: optimizer.type: unsupported optimizer \"OneBitLamb\"", "Adam",
               "AdamW", "Adagrad", "Lion"});
  ExpectError(ParseDeepSpeed(R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})"),
              StatusCode::kInvalidArgument, {"optimizer.params.amsgrad", "not supported"});
}

TEST(DeepSpeedConfigTest, NvmeOffloadNeedsNvmePath) {
  ExpectError(ParseDeepSpeed(R"({"zero_optimization": {"stage": 3,
                  "offload_optimizer": {"device": "nvme", "pin_memory": true}}})"),
              StatusCode::kInvalidArgument,
              {"zero_optimization.offload_optimizer.device: is \"nvme\" but "
               "zero_optimization.offload_optimizer.nvme_path is not set"});
  ExpectError(ParseDeepSpeed(R"({"zero_optimization": {"stage": 3,
                  "offload_param": {"device": "nvme"}}})"),
              StatusCode::kInvalidArgument,
              {"zero_optimization.offload_param.device", "offload_param.nvme_path is not set"});
  ExpectError(ParseDeepSpeed(R"({"zero_optimization": {"stage": 3,
                  "offload_param": {"device": "nvme", "nvme_path": ""}}})"),
              StatusCode::kInvalidArgument, {"zero_optimization.offload_param.nvme_path"});
}

TEST(DeepSpeedConfigTest, Fp16AndBf16BothEnabledIsAnError) {
  ExpectError(ParseDeepSpeed(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})"),
              StatusCode::kInvalidArgument,
              {"ds_config.json", "fp16.enabled and bf16.enabled are both true"});
  Result<LoadedConfig> bf16 = ParseDeepSpeed(R"({"fp16": {"enabled": false},
                                                 "bf16": {"enabled": true}})");
  ASSERT_TRUE(bf16.ok()) << bf16.status().ToString();
  EXPECT_EQ(bf16->options.precision.working_dtype, DType::kBf16);
  // bf16 working dtype halves the element-to-byte conversion of fp32.
  EXPECT_EQ(bf16->options.host.buffer_size, 200'000'000u);
  // The older spelling "bfloat16".
  Result<LoadedConfig> legacy = ParseDeepSpeed(R"({"bfloat16": {"enabled": true}})");
  ASSERT_TRUE(legacy.ok()) << legacy.status().ToString();
  EXPECT_EQ(legacy->options.precision.working_dtype, DType::kBf16);
}

TEST(DeepSpeedConfigTest, WrongTypesAndValuesNameTheKeyPath) {
  struct Case {
    const char* json;
    std::string message;
  };
  const std::vector<Case> cases = {
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"buffer_count": -2}}})",
       "zero_optimization.offload_optimizer.buffer_count: expected a positive integer, got -2"},
      {R"({"zero_optimization": {"stage": "3"}})",
       "zero_optimization.stage: expected an integer in [0, 3], got \"3\""},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"pin_memory": "yes"}}})",
       "zero_optimization.offload_optimizer.pin_memory: expected true or false, got \"yes\""},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}})",
       "zero_optimization.offload_optimizer.device: expected one of \"none\", \"cpu\", "
       "\"nvme\", got \"gpu\""},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"buffer_size": -100000000}}})",
       "zero_optimization.offload_param.buffer_size: expected a positive integer, got "
       "-100000000"},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"max_in_cpu": -1}}})",
       "zero_optimization.offload_param.max_in_cpu: expected a non-negative integer, got -1"},
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 1.5}}})",
       "zero_optimization.offload_optimizer.ratio: expected a number in [0, 1], got 1.5"},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"ratio": 0.5}}})",
       "zero_optimization.offload_optimizer.ratio: partial offload (0.5 < 1) needs "
       "zero_optimization.stage 3, got 2"},
      {R"({"zero_optimization": "yes"})", "zero_optimization: expected an object, got \"yes\""},
      {R"({"aio": {"block_size": -1048576}})",
       "aio.block_size: expected a positive multiple of 4096 (bytes), like 1048576, got "
       "-1048576"},
      {R"({"aio": {"block_size": 1000}})", "aio.block_size: expected a positive multiple of 4096"},
      {R"({"aio": {"queue_depth": 0}})",
       "aio.queue_depth: expected an integer in [1, 32768], got 0"},
      {R"({"aio": {"thread_count": 2, "intra_op_parallelism": 4}})",
       "aio.intra_op_parallelism: 4 differs from aio.thread_count 2"},
      {R"({"optimizer": {"type": "Adam", "params": {"lr": -0.1}}})",
       "optimizer.params.lr: expected a number >= 0, got -0.1"},
      {R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}})",
       "optimizer.params.betas: expected two numbers in [0, 1), like [0.9, 0.999], got "
       "[0.9,1.0]"},
      {R"({"optimizer": {"type": "Adam", "params": {"betas": 0.9}}})",
       "optimizer.params.betas: expected two numbers in [0, 1)"},
      {R"({"optimizer": {"type": "Adam", "params": {"eps": 0}}})",
       "optimizer.params.eps: expected a number > 0, got 0"},
      {R"({"optimizer": {"type": 3}})", "optimizer.type: expected a string, got 3"},
      {R"({"fp16": {"enabled": true, "hysteresis": 0}})",
       "fp16.hysteresis: expected a positive integer, got 0"},
      {R"({"fp16": {"enabled": true, "loss_scale": -1}})",
       "fp16.loss_scale: expected a number >= 0, got -1"},
      {R"({"fp16": {"enabled": 1}})", "fp16.enabled: expected true or false, got 1"},
      {R"({"gradient_clipping": -1.0})", "gradient_clipping: expected a number >= 0, got -1.0"},
      {R"({"gradient_accumulation_steps": 0})",
       "gradient_accumulation_steps: expected a positive integer, got 0"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.json);
    ExpectError(ParseDeepSpeed(c.json), StatusCode::kInvalidArgument,
                {"ds_config.json: " + c.message});
  }
}

TEST(DeepSpeedConfigTest, OffloadSectionsFollowTheStageAsInDeepSpeed) {
  // offload_param is a stage-3 feature: at stage 2 DeepSpeed ignores it, and so does Strata.
  Result<LoadedConfig> loaded = ParseDeepSpeed(R"({"zero_optimization": {"stage": 2,
      "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->options.placement.optimizer_states, Tier::kHost);
  EXPECT_EQ(loaded->options.placement.params, Tier::kDevice);
  EXPECT_EQ(loaded->ignored_keys, std::vector<std::string>{"zero_optimization.offload_param"});

  Result<LoadedConfig> stage3 = ParseDeepSpeed(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": false},
      "offload_param": {"device": "cpu", "pin_memory": true}}})");
  ASSERT_TRUE(stage3.ok()) << stage3.status().ToString();
  EXPECT_EQ(stage3->options.placement.optimizer_states, Tier::kHost);
  EXPECT_EQ(stage3->options.placement.params, Tier::kHost);
  EXPECT_TRUE(stage3->options.host.pin_memory);  // either section asking for it pins
  EXPECT_TRUE(stage3->options.nvme.paths.empty());
}

TEST(DeepSpeedConfigTest, DeprecatedSpellings) {
  Result<LoadedConfig> loaded = ParseDeepSpeed(R"({"zero_optimization": {"stage": 3,
      "cpu_offload": true, "cpu_offload_param": true, "cpu_offload_use_pin_memory": true},
      "aio": {"intra_op_parallelism": 3}})");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->options.placement.optimizer_states, Tier::kHost);
  EXPECT_EQ(loaded->options.placement.params, Tier::kHost);
  EXPECT_TRUE(loaded->options.host.pin_memory);
  EXPECT_EQ(loaded->options.nvme.thread_count, 3);

  Result<LoadedConfig> boolean = ParseDeepSpeed(R"({"zero_optimization": true})");
  ASSERT_TRUE(boolean.ok()) << boolean.status().ToString();
  EXPECT_EQ(boolean->options.placement.zero_stage, 1);
}

TEST(DeepSpeedConfigTest, NullCountsAsAbsent) {
  Result<LoadedConfig> loaded =
      ParseDeepSpeed(R"({"zero_optimization": {"stage": 2, "offload_optimizer": null},
                         "aio": null})");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->options.placement.optimizer_states, Tier::kDevice);
  EXPECT_TRUE(loaded->ignored_keys.empty());
}

// Valid for DeepSpeed, not for Strata: offloaded parameters while the GPU keeps (some of) the
// optimizer states. Refused when the config is read, in the keys the user wrote.
TEST(DeepSpeedConfigTest, OffloadedParametersWithGpuKeptStatesAreRefusedInDeepSpeedKeys) {
  ExpectError(
      ParseDeepSpeed(R"({"zero_optimization":{"stage":3,"offload_param":{"device":"cpu"}}})"),
      StatusCode::kInvalidArgument,
      {"ds_config.json: zero_optimization.offload_param.device is \"cpu\"",
       "no zero_optimization.offload_optimizer", "offload_optimizer.device"});
  ExpectError(ParseDeepSpeed(R"({"zero_optimization": {"stage": 3,
                  "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                  "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}})"),
              StatusCode::kInvalidArgument,
              {"offload_param.device is \"nvme\"",
               "zero_optimization.offload_optimizer.ratio 0.5 keeps part of them on the GPU"});
  // The same placement in Strata's format fails EngineOptions::Validate, which Create runs too.
  ExpectError(ParseConfig(R"({"placement": {"optimizer_states": "device", "params": "host"}})"),
              StatusCode::kInvalidArgument,
              {"need the working parameters there too", "placement.params is \"host\""});
}

TEST(DeepSpeedConfigTest, MappedConfigIsValidated) {
  // Values each fine on their own but not as Strata uses them: 1000 fp32 elements is a
  // staging buffer smaller than one 4 KiB block.
  ExpectError(ParseDeepSpeed(R"({"zero_optimization": {"stage": 3,
                  "offload_optimizer": {"device": "cpu"},
                  "offload_param": {"device": "cpu", "buffer_size": 1000}}})"),
              StatusCode::kInvalidArgument,
              {"ds_config.json: host.buffer_size is 4000",
               "DeepSpeed: zero_optimization.offload_param.buffer_size"});
}

}  // namespace
}  // namespace strata
