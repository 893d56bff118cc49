#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "cli_support.h"

namespace strata::tools {
namespace {

using testing::RunCli;

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

size_t LineCount(const std::string& text) {
  return static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
}

TEST(CliTest, HelpListsCommands) {
  auto r = RunCli("--help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("info"), std::string::npos);
  EXPECT_NE(r.out.find("config check"), std::string::npos);
  for (const char* command : {"info --help", "config check --help", "config --help"}) {
    auto h = RunCli(command);
    EXPECT_EQ(h.exit_code, 0) << command;
    EXPECT_NE(h.out.find("Usage:"), std::string::npos) << command;
  }
}

TEST(CliTest, UnknownCommandAndFlagsAreOneLineErrors) {
  auto r = RunCli("frobnicate");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(LineCount(r.out), 1u) << r.out;
  EXPECT_NE(r.out.find("unknown command \"frobnicate\""), std::string::npos);

  r = RunCli("info --bogus");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(LineCount(r.out), 1u) << r.out;
  EXPECT_NE(r.out.find("unknown flag --bogus"), std::string::npos);

  r = RunCli("info --path");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--path needs a value"), std::string::npos);

  r = RunCli("config check");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("missing FILE"), std::string::npos);

  r = RunCli("config check x.json --format yaml");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("yaml"), std::string::npos);
}

TEST(CliTest, InfoJsonHasTheFacts) {
  auto r = RunCli("info --json --path " + ::testing::TempDir(), /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["cpu"]["logical_cpus"].get<int>(), static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
  EXPECT_TRUE(j["cpu"]["simd"].contains("avx512bf16"));
  EXPECT_GT(j["memory"]["total_bytes"].get<uint64_t>(), 0u);
  EXPECT_TRUE(j["memory"].contains("memlock_soft"));
  EXPECT_TRUE(j["io_uring"]["available"].is_boolean());
  if (!j["io_uring"]["available"].get<bool>()) {
    EXPECT_FALSE(j["io_uring"]["reason"].get<std::string>().empty());
  }
  EXPECT_GT(j["path"]["direct_io_offset_alignment"].get<uint32_t>(), 0u);
  EXPECT_TRUE(j["cuda"]["built"].is_boolean());
  if (!j["cuda"]["available"].get<bool>()) {
    EXPECT_FALSE(j["cuda"]["reason"].get<std::string>().empty());
  }
  EXPECT_TRUE(j["versions"].contains("liburing"));
}

TEST(CliTest, InfoTableAndBadPath) {
  auto r = RunCli("info");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("RLIMIT_MEMLOCK"), std::string::npos);
  r = RunCli("info --path /nonexistent/strata");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("/nonexistent/strata does not exist"), std::string::npos);
}

TEST(CliTest, ConfigCheckDeepSpeed) {
  const std::string path = WriteTemp("ds_config.json", R"({
    "train_batch_size": 16,
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    "bf16": {"enabled": true}
  })");
  auto r = RunCli("config check " + path);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("valid deepspeed config"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("train_batch_size"), std::string::npos) << "ignored keys are listed";
  EXPECT_NE(r.out.find("\"nvme\""), std::string::npos);
  // stdout alone is the resolved options in Strata's format.
  auto out = RunCli("config check " + path, /*merge_stderr=*/false);
  auto j = nlohmann::json::parse(out.out);
  EXPECT_EQ(j["placement"]["optimizer_states"], "nvme");
}

// One validation path: what `train` refuses, `config check` refuses too, with the same words.
TEST(CliTest, ConfigCheckRefusesWhatTrainRefuses) {
  const std::string path =
      WriteTemp("ds_offload_param.json",
                R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})");
  auto check = RunCli("config check " + path);
  EXPECT_NE(check.exit_code, 0) << check.out;
  EXPECT_NE(check.out.find("zero_optimization.offload_param.device"), std::string::npos)
      << check.out;
  auto train = RunCli("train --steps 1 --config " + path);
  EXPECT_EQ(train.exit_code, check.exit_code) << train.out;
  EXPECT_NE(train.out.find("zero_optimization.offload_param.device"), std::string::npos)
      << train.out;
}

TEST(CliTest, ConfigCheckBadFiles) {
  auto r = RunCli("config check /nonexistent/ds.json");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("/nonexistent/ds.json"), std::string::npos);
  const std::string bad = WriteTemp("bad.json", R"({"zero_optimization": {"stage": 3,)");
  r = RunCli("config check " + bad);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("bad.json"), std::string::npos) << r.out;
  EXPECT_EQ(LineCount(r.out), 1u) << r.out;
}

TEST(CliTest, BenchNvmeReportsBothPassesAsJson) {
  auto r = RunCli("bench nvme --path " + ::testing::TempDir() +
                      " --size 8MiB --block-size 256KiB --queue-depth 4 --json",
                  /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0]["rw"], "write");
  EXPECT_EQ(j[1]["rw"], "read");
  for (const auto& pass : j) {
    EXPECT_EQ(pass["block_size"].get<uint64_t>(), 256u << 10);
    EXPECT_EQ(pass["queue_depth"].get<uint32_t>(), 4u);
    EXPECT_EQ(pass["bytes"].get<uint64_t>(), 8u << 20);
    EXPECT_GT(pass["seconds"].get<double>(), 0.0);
    EXPECT_NEAR(pass["bytes_per_second"].get<double>(),
                pass["bytes"].get<double>() / pass["seconds"].get<double>(), 1.0);
  }
}

TEST(CliTest, BenchNvmeBadInput) {
  auto r = RunCli("bench nvme");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--path is required"), std::string::npos);
  r = RunCli("bench nvme --path /tmp --rw sideways");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("sideways"), std::string::npos);
  r = RunCli("bench nvme --path /nonexistent/dir --size 1MiB");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("/nonexistent/dir"), std::string::npos) << r.out;
  r = RunCli("bench warp");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("unknown benchmark \"warp\""), std::string::npos);
}

TEST(CliTest, BenchPipelineMeasuresEveryResourceAndTheStep) {
  for (const char* tier : {"host", "nvme"}) {
    auto r = RunCli(std::string("bench pipeline --chunks 3 --chunk-size 256KiB --forward-ms 2 ") +
                        "--backward-ms 3 --copy-gbps 0 --warmup 1 --steps 3 --json " +
                        "--offload-optimizer " + tier + " --nvme-path " + ::testing::TempDir(),
                    /*merge_stderr=*/false);
    ASSERT_EQ(r.exit_code, 0) << tier << ": " << r.out;
    auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["offload_optimizer"], tier);
    EXPECT_EQ(j["chunks"], 3);
    EXPECT_EQ(j["params"].get<uint64_t>(), 3u * (128u << 10));  // 256KiB of bf16 per chunk.
    const auto& resources = j["resources"];
    for (const char* name : {"compute", "device_to_host", "cpu_adam", "host_to_device"}) {
      ASSERT_TRUE(resources.contains(name)) << name;
      EXPECT_GT(resources[name]["seconds"].get<double>(), 0.0) << name;
    }
    EXPECT_EQ(resources.contains("nvme_read"), std::string(tier) == "nvme");
    if (std::string(tier) == "nvme") {
      // Timed before the steps and after them: the reference is the mean.
      const double before = j["nvme_before_seconds"].get<double>();
      const double after = j["nvme_after_seconds"].get<double>();
      EXPECT_GT(before, 0.0);
      EXPECT_GT(after, 0.0);
      EXPECT_NEAR(resources["nvme_read"]["seconds"].get<double>() +
                      resources["nvme_write"]["seconds"].get<double>(),
                  (before + after) / 2, 1e-9);
    } else {
      EXPECT_EQ(j["nvme_after_seconds"].get<double>(), 0.0);
    }
    // Compute alone is 3 chunks x (2 + 3) ms of sleeping.
    EXPECT_GE(resources["compute"]["seconds"].get<double>(), 0.015);
    ASSERT_EQ(j["step_seconds"].size(), 3u);
    double serial = 0.0;
    for (const auto& [name, resource] : resources.items())
      serial += resource["seconds"].get<double>();
    EXPECT_NEAR(j["serial_seconds"].get<double>(), serial, 1e-9);
    EXPECT_NEAR(j["ratio_to_slowest"].get<double>(),
                j["step_median_seconds"].get<double>() / j["slowest_seconds"].get<double>(), 1e-9);
  }
}

// Gated steps: with zero synthetic gradients nothing clips and no speculative update is
// undone; --clip-triggered clips every step, each rolled back and redone.
TEST(CliTest, BenchPipelineClipsWhenAskedToAndSaysWhatRolledBack) {
  for (const char* clip : {"--gradient-clipping 1.0", "--clip-triggered",
                           "--gradient-clipping 0.5 --no-speculation --precision fp16"}) {
    for (const char* tier : {"host", "nvme"}) {
      auto r = RunCli(std::string("bench pipeline --chunks 3 --chunk-size 256KiB --forward-ms 1 ") +
                          "--backward-ms 1 --copy-gbps 0 --warmup 1 --steps 2 --json " + clip +
                          " --offload-optimizer " + tier + " --nvme-path " + ::testing::TempDir(),
                      /*merge_stderr=*/false);
      ASSERT_EQ(r.exit_code, 0) << clip << ", " << tier << ": " << r.out;
      auto j = nlohmann::json::parse(r.out);
      const bool triggered = std::string(clip) == "--clip-triggered";
      EXPECT_EQ(j["clip_triggered"], triggered) << clip;
      EXPECT_DOUBLE_EQ(
          j["gradient_clipping"].get<double>(),
          triggered ? 1.0 : std::stod(std::string(clip).substr(std::string(clip).find(' ') + 1)));
      EXPECT_EQ(j["speculative_updates"],
                std::string(clip).find("--no-speculation") == std::string::npos);
      EXPECT_EQ(j["rolled_back_steps"], triggered ? 2 : 0) << clip << ", " << tier;
    }
  }
}

// With the working parameters homed on host (how a model larger than memory runs on HostDevice,
// whose device memory is host memory too), forward and backward each fetch every chunk, so the
// host->device reference copies twice the bytes the device->host one does; the engine's host
// memory stays within its budget and the process's peak is reported.
TEST(CliTest, BenchPipelineWithParametersOnHostFetchesEachChunkTwice) {
  auto r =
      RunCli(std::string("bench pipeline --chunks 6 --chunk-size 256KiB --forward-ms 1 ") +
                 "--backward-ms 1 --copy-gbps 0 --warmup 1 --steps 2 --json " +
                 "--offload-param cpu --offload-optimizer nvme --nvme-path " + ::testing::TempDir(),
             /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["offload_param"], "host");
  const auto& resources = j["resources"];
  EXPECT_EQ(resources["host_to_device"]["bytes"].get<uint64_t>(), 2u * 6 * (256u << 10));
  EXPECT_EQ(resources["device_to_host"]["bytes"].get<uint64_t>(), 6u * (256u << 10));
  // Parameters (twice: the update writes a second copy), gradients and the state staging.
  EXPECT_GE(j["host_peak_bytes"].get<uint64_t>(), 3u * 6 * (256u << 10));
  EXPECT_LE(j["host_peak_bytes"].get<uint64_t>(), j["host_budget_bytes"].get<uint64_t>());
  // HostDevice's memory is RAM too: the engine's automatic budget leaves it out.
  const uint64_t device_bytes = 2u * 4 * (256u << 10) + (1u << 20);  // 4 chunk slots.
  EXPECT_EQ(j["host_budget_bytes"].get<uint64_t>(),
            j["physical_memory_bytes"].get<uint64_t>() / 100 * 80 - device_bytes);
  EXPECT_GT(j["peak_rss_bytes"].get<uint64_t>(), 0u);
  EXPECT_GT(j["physical_memory_bytes"].get<uint64_t>(), j["peak_rss_bytes"].get<uint64_t>());
}

TEST(CliTest, BenchPipelineBadInput) {
  auto r = RunCli("bench pipeline --offload-optimizer nvme");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--nvme-path"), std::string::npos) << r.out;
  r = RunCli("bench pipeline --offload-optimizer tape");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("tape"), std::string::npos) << r.out;
  r = RunCli("bench pipeline --chunk-size 1000");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("multiple of 4KiB"), std::string::npos) << r.out;
  r = RunCli("bench pipeline --offload-optimizer nvme --nvme-path /nonexistent/dir --chunks 1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("/nonexistent/dir"), std::string::npos) << r.out;
  r = RunCli("bench pipeline --gradient-clipping -1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--gradient-clipping must be"), std::string::npos) << r.out;
  r = RunCli("bench pipeline --offload-param nvme");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--offload-param must be device or host"), std::string::npos) << r.out;
  r = RunCli("bench pipeline --offload-param host --delayed-update");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--delayed-update needs"), std::string::npos) << r.out;
  r = RunCli("bench pipeline --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("--offload-optimizer"), std::string::npos);
  EXPECT_NE(r.out.find("--offload-param"), std::string::npos);
  EXPECT_NE(r.out.find("--clip-triggered"), std::string::npos);
}

// The run itself, its files and its charts: bench_all_test.py (ctest bench_all_to_charts).
TEST(CliTest, BenchAllBadInputFailsBeforeMeasuring) {
  auto r = RunCli("bench all --nvme-path /nonexistent/dir");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("/nonexistent/dir is not a directory"), std::string::npos) << r.out;
  r = RunCli("bench all --out /dev/null/charts");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("creating /dev/null/charts"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[1/4]"), std::string::npos) << "measured before failing: " << r.out;
  r = RunCli("bench all --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("--out"), std::string::npos);
}

TEST(CliTest, PlanPrintsTheClassicZeroTable) {
  auto r = RunCli("plan --params 10e9 --gpus 8 --json", /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  std::map<std::string, double> gpu_bytes;
  for (const auto& p : j["placements"]) {
    gpu_bytes[p["name"]] = p["device_bytes"]["total"].get<double>();
  }
  EXPECT_DOUBLE_EQ(gpu_bytes["data parallel"], 160e9);
  EXPECT_DOUBLE_EQ(gpu_bytes["ZeRO-1"], 55e9);
  EXPECT_DOUBLE_EQ(gpu_bytes["ZeRO-2"], 37.5e9);
  EXPECT_DOUBLE_EQ(gpu_bytes["ZeRO-3"], 20e9);
  EXPECT_EQ(j["placements"].size(), 9u);

  r = RunCli("plan --params 10e9 --gpus 8");
  ASSERT_EQ(r.exit_code, 0);
  for (const char* figure : {"160.0", "55.0", "37.5", "20.0", "3 Psi"}) {
    EXPECT_NE(r.out.find(figure), std::string::npos) << figure << "\n" << r.out;
  }
  EXPECT_EQ(RunCli("plan").exit_code, 2);
  EXPECT_EQ(RunCli("plan --params 1e9 --gpus 0").exit_code, 2);
  EXPECT_EQ(RunCli("plan --params 1e9 --precision fp8").exit_code, 2);
}

// ZeRO++ shrinks ZeRO-3's collectives only: int8 gathers and int4 gradients, with the scales,
// 2 x 1.015625 + 0.515625 bytes a parameter against fp16's 6.
TEST(CliTest, PlanCountsZeroPlusPlusBytes) {
  auto r = RunCli(
      "plan --params 10e9 --gpus 8 --json --zero-quantized-weights --zero-quantized-gradients "
      "--zero-quantized-gradient-bits 4",
      /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["quantized_gradient_bits"], 4);
  std::map<std::string, double> comm;
  for (const auto& p : j["placements"]) comm[p["name"]] = p["comm_bytes_per_step"].get<double>();
  EXPECT_DOUBLE_EQ(comm["ZeRO-3"], 10e9 * (2 * 1.015625 + 0.515625));
  EXPECT_DOUBLE_EQ(comm["ZeRO-2"], 40e9);
  r = RunCli("plan --params 10e9 --gpus 8 --zero-quantized-gradients");
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("gradients reduced as blockwise int8"), std::string::npos) << r.out;
  r = RunCli("plan --params 1e9 --zero-quantized-gradient-bits 3");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--zero-quantized-gradient-bits must be 8 or 4, got 3"), std::string::npos)
      << r.out;
}

TEST(CliTest, PlanPicksTheFastestPlacementThatFits) {
  const std::string machine =
      "plan --params 1e9 --precision bf16 --h2d-gbps 20 --d2h-gbps 20 --nvme-read-gbps 4 "
      "--nvme-write-gbps 2 --optimizer-gparams 1 --compute-seconds 3 ";
  auto r = RunCli(machine + "--device-memory 10GB --json", /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["chosen"], "ZeRO-2, optimizer -> host");
  EXPECT_EQ(j["machine"]["nvme_read_bytes_per_second"].get<double>(), 4e9);
  for (const auto& p : j["placements"]) {
    const auto& prediction = p["prediction"];
    if (p["name"] == "data parallel") {
      EXPECT_FALSE(prediction["fits"].get<bool>());
    }
    if (p["name"] == "ZeRO-2, optimizer -> nvme") {
      // The drives' 12/4 + 12/2: forward's second of reads runs ahead of backward (host
      // memory unknown: staging for every chunk), the upload (2/20) in the pipeline.
      EXPECT_DOUBLE_EQ(prediction["step_seconds"].get<double>(), 9.0);
      EXPECT_EQ(prediction["bound_by"], "nvme");
    }
  }
  // Host memory too small for the states: each NVMe placement also comes split, as much of its
  // states in host memory as 90% of it holds after the rest (here 9 GB - 2 GB of gradients), and
  // NVMe carries only the remainder (5 of 12 GB): forward 1 + states 5/4 + 5/2, less the reads
  // ahead of backward: with no host memory left, the fewest staging buffers, 4, read 3 of its 13
  // chunks of 384MiB ahead.
  r = RunCli(machine + "--device-memory 10GB --host-memory 10GB --json", /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["chosen"], "ZeRO-2, optimizer -> nvme, states split host + nvme");
  for (const auto& p : j["placements"]) {
    if (p["name"] != "ZeRO-2, optimizer -> nvme, states split host + nvme") continue;
    EXPECT_DOUBLE_EQ(p["max_states_in_host"].get<double>(), 7e9);
    EXPECT_DOUBLE_EQ(p["nvme_bytes"]["optimizer_states"].get<double>(), 5e9);
    EXPECT_DOUBLE_EQ(p["prediction"]["step_seconds"].get<double>(), 4.75 - 5.0 / 4 * 3 / 13);
  }
  r = RunCli(machine + "--device-memory 10GB --host-memory 10GB");
  EXPECT_NE(r.out.find("Run it with --max-states-in-host 6.52GiB"), std::string::npos) << r.out;
  // The table marks the choice; too little of everything fits nothing, and says so.
  r = RunCli(machine + "--device-memory 10GB");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("* ZeRO-2, optimizer -> host"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Chosen: ZeRO-2, optimizer -> host"), std::string::npos) << r.out;
  r = RunCli(machine + "--device-memory 1GB --host-memory 1GB --nvme-bytes 1GB");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("no placement fits"), std::string::npos) << r.out;
  // Rates not given are named, and the step times they leave out marked as lower bounds.
  r = RunCli("plan --params 1e9 --compute-seconds 1");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("Not counted"), std::string::npos) << r.out;
  EXPECT_EQ(RunCli("plan --params 1e9 --tokens 4096").exit_code, 2);
  EXPECT_EQ(RunCli("plan --params 1e9 --h2d-gbps -1").exit_code, 2);
  EXPECT_EQ(RunCli("plan --params 1e9 --measure --chunk-size 1000").exit_code, 2);
  // A bad --nvme-path fails before anything is measured; measuring settings need --measure.
  r = RunCli("plan --params 1e9 --measure --nvme-path /nonexistent/dir --chunk-size 64KiB");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("/nonexistent/dir is not a directory"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("measuring"), std::string::npos) << r.out;
  r = RunCli("plan --params 1e9 --compute-seconds 1 --nvme-path /tmp");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("a setting of --measure"), std::string::npos) << r.out;
}

// A short run of the tiny model, quick enough for a test.
std::string TinyTrain(const std::string& extra) {
  return "train --model tiny --batch 2 --seq 32 --eval-every 0 --nvme-path " +
         ::testing::TempDir() + " " + extra;
}

std::vector<double> Losses(const nlohmann::json& document) {
  std::vector<double> losses;
  for (const auto& step : document["steps"]) losses.push_back(step["loss"].get<double>());
  return losses;
}

// Started as one of several ranks, train shards one model across them (train_2_ranks runs it
// under mpirun); what is not built for several ranks says so, naming the rank, before anything
// starts, and malformed launcher variables are usage errors naming them.
TEST(CliTest, TrainAcrossRanksNamesTheRankInItsErrors) {
  auto r =
      RunCli("train --model tiny --steps 0", true, "OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("rank 1 of 2: --steps must be in"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("step 1"), std::string::npos) << r.out;
  r = RunCli("train --model tiny --steps 1", true, "RANK=2 WORLD_SIZE=2");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("RANK=\"2\" is not a number in [0, 1]"), std::string::npos) << r.out;
}

TEST(CliTest, TrainJsonHasEveryStepAndTheLossFalls) {
  auto r = RunCli(TinyTrain("--steps 30 --lr 1e-2 --json"), /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["steps"].size(), 30u);
  for (size_t i = 0; i < 30; ++i) EXPECT_EQ(j["steps"][i]["step"].get<int>(), int(i) + 1);
  EXPECT_EQ(j["placement"]["optimizer_states"], "nvme");
  EXPECT_EQ(j["placement"]["params"], "host");
  const std::vector<double> losses = Losses(j);
  EXPECT_LT(losses.back(), losses.front() - 0.5);
  EXPECT_LT(j["validation_loss"].get<double>(), j["unigram_entropy"].get<double>());
  EXPECT_GT(j["summary"]["nvme_write_bytes"].get<uint64_t>(), 0u);
}

TEST(CliTest, TrainWithDelayedUpdatesStillLearnsAndDiffersOnlyFromTheDelay) {
  // The same run with and without delayed updates: the same steps up to the first delayed one
  // and its successor, different ones after, and the loss falls all the same. A checkpoint
  // every 5 steps makes those steps complete before the next forward (and sends what they
  // held back: the next step uses the newest parameters, from a trajectory already apart).
  auto run = [](const std::string& extra) {
    auto r = RunCli(TinyTrain("--steps 30 --lr 1e-2 --offload-params device --json " + extra),
                    /*merge_stderr=*/false);
    EXPECT_EQ(r.exit_code, 0) << r.out;
    return nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  };
  const auto exact = run("");
  const auto delayed =
      run("--delayed-update --delayed-update-from 3 --checkpoint-every 5 "
          "--checkpoint " +
          ::testing::TempDir() + "/delayed_checkpoint");
  ASSERT_FALSE(exact.is_discarded());
  ASSERT_FALSE(delayed.is_discarded());
  ASSERT_EQ(delayed["steps"].size(), 30u);
  EXPECT_EQ(delayed["optimizer"]["delayed_update"], true);
  EXPECT_EQ(delayed["optimizer"]["delayed_update_from_step"], 3);
  const std::vector<double> a = Losses(exact), b = Losses(delayed);
  for (size_t i = 0; i < 30; ++i) EXPECT_EQ(delayed["steps"][i]["step"].get<int>(), int(i) + 1);
  for (size_t i = 0; i <= 3; ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  for (size_t i = 4; i < 30; ++i) EXPECT_NE(a[i], b[i]) << "step " << i + 1;
  EXPECT_LT(b.back(), b.front() - 0.5);

  // Parameters that live off the device cannot be held back: a clear error, no crash.
  auto refused = RunCli(TinyTrain("--steps 2 --delayed-update"));
  EXPECT_EQ(refused.exit_code, 1) << refused.out;
  EXPECT_NE(refused.out.find("--offload-params device"), std::string::npos) << refused.out;
  EXPECT_EQ(RunCli(TinyTrain("--steps 2 --delayed-update-from 3")).exit_code, 2);
}

TEST(CliTest, TrainTakesADeepSpeedConfig) {
  const std::string config = WriteTemp("ds_train.json", R"({
    "train_batch_size": 16,
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                          "offload_param": {"device": "cpu"}}})");
  auto r = RunCli(TinyTrain("--steps 3 --json --config " + config), /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["placement"]["optimizer_states"], "host");
  EXPECT_EQ(j["placement"]["params"], "host");
  EXPECT_EQ(j["placement"]["precision"], "bf16");
  EXPECT_EQ(j["steps"].size(), 3u);
  // DeepSpeed has no chunk size: train's own stands (the engine's 64MiB would make one chunk).
  auto plain = RunCli(TinyTrain("--steps 1 --json"), /*merge_stderr=*/false);
  ASSERT_EQ(plain.exit_code, 0) << plain.out;
  const int chunks = nlohmann::json::parse(plain.out)["placement"]["chunks"].get<int>();
  EXPECT_GT(chunks, 1);
  EXPECT_EQ(j["placement"]["chunks"].get<int>(), chunks);
  // Flags given override the file.
  r = RunCli(TinyTrain("--steps 2 --json --offload-optimizer nvme --config " + config),
             /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out)["placement"]["optimizer_states"], "nvme");
}

// A Strata config that names a chunk size gets it; one that does not keeps train's.
TEST(CliTest, TrainTakesTheChunkSizeOnlyFromAConfigThatGivesIt) {
  auto chunks_with = [](const std::string& config) {
    auto r = RunCli(TinyTrain("--steps 1 --json --config " + config), /*merge_stderr=*/false);
    EXPECT_EQ(r.exit_code, 0) << r.out;
    return r.exit_code == 0 ? nlohmann::json::parse(r.out)["placement"]["chunks"].get<int>() : -1;
  };
  const int silent = chunks_with(WriteTemp("strata_no_chunk.json", R"({
    "placement": {"optimizer_states": "host"}})"));
  const int whole = chunks_with(WriteTemp("strata_big_chunk.json", R"({
    "placement": {"optimizer_states": "host", "chunk_bytes": "64MiB"}})"));
  EXPECT_GT(silent, 1);
  EXPECT_EQ(whole, 1);
}

// A fixed fp16 loss scale far too high overflows every step: each is skipped, and the run still
// ends after --steps iterations, as DeepSpeed's would (it used to loop for ever).
TEST(CliTest, TrainEndsWhenEveryFp16StepOverflows) {
  const std::string config = WriteTemp("ds_fp16_overflow.json", R"({
    "train_batch_size": 16,
    "fp16": {"enabled": true, "loss_scale": 1e6},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})");
  auto r = RunCli(TinyTrain("--steps 3 --json --config " + config), /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["steps"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(j["steps"][i]["skipped"].get<bool>()) << i;
    EXPECT_EQ(j["steps"][i]["step"].get<int>(), 0) << i;
    EXPECT_EQ(j["steps"][i]["iteration"].get<int>(), int(i) + 1) << i;
  }
  EXPECT_EQ(j["summary"]["skipped_steps"].get<int>(), 3);
}

// Clipping just under the first step's norm: that step's first chunks update ahead of the
// verdict and are redone, and train says so; clipping that never fires redoes nothing.
TEST(CliTest, TrainSaysWhichStepsRedidTheirSpeculativeUpdates) {
  auto config = [](double max_norm) {
    return WriteTemp("ds_clip.json", R"({"train_batch_size": 2, "gradient_clipping": )" +
                                         std::to_string(max_norm) + R"(,
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})");
  };
  auto r = RunCli(TinyTrain("--steps 2 --chunk-size 16KiB --json --config " + config(1e6)),
                  /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_GT(j["placement"]["chunks"].get<int>(), 2);
  EXPECT_EQ(j["summary"]["rolled_back_steps"].get<int>(), 0);
  const double first_norm = j["steps"][0]["grad_norm"].get<double>();
  ASSERT_GT(first_norm, 0.0);

  r = RunCli(TinyTrain("--steps 2 --chunk-size 16KiB --json --config " + config(0.99 * first_norm)),
             /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  j = nlohmann::json::parse(r.out);
  EXPECT_DOUBLE_EQ(j["steps"][0]["grad_norm"].get<double>(), first_norm);
  EXPECT_TRUE(j["steps"][0]["rolled_back"].get<bool>()) << j["steps"][0];
  EXPECT_GE(j["summary"]["rolled_back_steps"].get<int>(), 1);
  r = RunCli(TinyTrain("--steps 2 --chunk-size 16KiB --config " + config(0.99 * first_norm)));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("steps that redid updates (clip)"), std::string::npos) << r.out;
}

// DeepSpeed's batch sizes drive train: 6 = 3 x 2 x 1 gives micro-batches of 3 sequences and
// two of them per step; the run reports its learning rate, accumulation and loss scale.
TEST(CliTest, TrainTakesItsBatchAndAccumulationFromADeepSpeedConfig) {
  const std::string config = WriteTemp("ds_batch.json", R"({
    "train_batch_size": 6, "train_micro_batch_size_per_gpu": 3,
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})");
  const std::string train = "train --model tiny --seq 32 --eval-every 0 --steps 1 --json --config ";
  auto r = RunCli(train + config, /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["optimizer"]["micro_batch"].get<int>(), 3);
  EXPECT_EQ(j["optimizer"]["gradient_accumulation_steps"].get<int>(), 2);
  EXPECT_DOUBLE_EQ(j["optimizer"]["lr"].get<double>(), 5e-4);
  EXPECT_DOUBLE_EQ(j["steps"][0]["loss_scale"].get<double>(), 1.0);
  // Without an optimizer section the optimizer is the trainer's: train's own lr (2e-3).
  const std::string no_optimizer =
      WriteTemp("ds_no_optimizer.json", R"({"train_micro_batch_size_per_gpu": 2})");
  r = RunCli(train + no_optimizer, /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(r.out)["optimizer"]["lr"].get<double>(), 2e-3);
  // A config's micro-batch beyond what train takes is the config's error (exit 1).
  const std::string huge =
      WriteTemp("ds_huge_batch.json", R"({"train_micro_batch_size_per_gpu": 100000})");
  auto too_big = RunCli(train + huge);
  EXPECT_EQ(too_big.exit_code, 1) << too_big.out;
  EXPECT_NE(too_big.out.find("train_micro_batch_size_per_gpu 100000"), std::string::npos)
      << too_big.out;
  // --batch still wins over the config.
  r = RunCli(train + config + " --batch 1", /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out)["optimizer"]["micro_batch"].get<int>(), 1);
  // An inconsistent triple is refused by check and train alike.
  const std::string bad = WriteTemp("ds_bad_batch.json", R"({"train_batch_size": 7,
      "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2})");
  auto check = RunCli("config check " + bad);
  EXPECT_EQ(check.exit_code, 1) << check.out;
  EXPECT_NE(check.out.find("train_batch_size 7 is not"), std::string::npos) << check.out;
  EXPECT_EQ(RunCli(train + bad).exit_code, 1);
  // With its world size it is checked as DeepSpeed would on that many ranks.
  const std::string four = WriteTemp("ds_four_ranks.json", R"({"train_batch_size": 24,
      "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2})");
  EXPECT_EQ(RunCli("config check " + four).exit_code, 1);
  auto ranks = RunCli("config check --world-size 4 " + four);
  EXPECT_EQ(ranks.exit_code, 0) << ranks.out;
  EXPECT_NE(ranks.out.find("x world size 4"), std::string::npos) << ranks.out;
}

// offload_optimizer.ratio < 1 keeps the first chunks' states on the device: the summary and
// the JSON say where they really are, chunk by chunk, not only what the config asked.
TEST(CliTest, TrainReportsWhereAPartialOffloadPutTheStates) {
  const std::string config = WriteTemp("ds_ratio.json", R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})");
  auto r = RunCli(
      "train --model tiny --batch 2 --seq 32 --eval-every 0 --steps 1 --json "
      "--chunk-size 64KiB --config " +
          config,
      /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto placement = nlohmann::json::parse(r.out)["placement"];
  const auto chunks = placement["optimizer_state_chunks"];
  ASSERT_TRUE(chunks.contains("device")) << placement.dump();
  ASSERT_TRUE(chunks.contains("host")) << placement.dump();
  EXPECT_EQ(chunks["device"].get<int>() + chunks["host"].get<int>(),
            placement["chunks"].get<int>());
  EXPECT_NE(placement["optimizer_states"].get<std::string>().find("device ("), std::string::npos)
      << placement.dump();
}

TEST(CliTest, TrainSpillsStatesPastMaxStatesInHostToNvme) {
  // The tiny model in 64 KiB chunks: a full chunk's states are 32768 x 12 bytes = 384 KiB.
  auto r = RunCli(
      "train --model tiny --batch 2 --seq 32 --eval-every 0 --steps 2 --json --chunk-size 64KiB "
      "--offload-optimizer nvme --max-states-in-host 800KiB --nvme-path " +
          ::testing::TempDir(),
      /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  const auto chunks = j["placement"]["optimizer_state_chunks"];
  ASSERT_TRUE(chunks.contains("host") && chunks.contains("nvme")) << j["placement"].dump();
  EXPECT_GE(chunks["host"].get<int>(), 2) << j["placement"].dump();
  EXPECT_EQ(chunks["host"].get<int>() + chunks["nvme"].get<int>(),
            j["placement"]["chunks"].get<int>());
  // The run's total, not one step's: a step's reads start as soon as the step before commits,
  // so which step's window they fall in depends on timing. The last step's reads are always
  // inside the run (its update cannot finish before them).
  EXPECT_GT(j["summary"]["nvme_read_bytes"].get<uint64_t>(), 0u);

  // Without states on nvme the option has nothing to spill: a command-line error saying so.
  r = RunCli("train --model tiny --steps 1 --offload-optimizer host --max-states-in-host 1MiB");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("max_states_in_host is set but"), std::string::npos) << r.out;
}

TEST(CliTest, TrainResumesFromACheckpointWithTheSameLosses) {
  const std::string checkpoint = ::testing::TempDir() + "strata-cli-ckpt";
  auto straight = RunCli(TinyTrain("--steps 8 --json"), /*merge_stderr=*/false);
  ASSERT_EQ(straight.exit_code, 0) << straight.out;
  auto first = RunCli(TinyTrain("--steps 4 --json --checkpoint " + checkpoint),
                      /*merge_stderr=*/false);
  ASSERT_EQ(first.exit_code, 0) << first.out;
  // Resumed with the optimizer states on the host instead of NVMe.
  auto resumed =
      RunCli(TinyTrain("--steps 8 --json --offload-optimizer host --resume " + checkpoint),
             /*merge_stderr=*/false);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out;
  const std::vector<double> all = Losses(nlohmann::json::parse(straight.out));
  const auto resumed_json = nlohmann::json::parse(resumed.out);
  ASSERT_EQ(resumed_json["steps"].size(), 4u);
  EXPECT_EQ(resumed_json["steps"][0]["step"].get<int>(), 5);
  const std::vector<double> tail = Losses(resumed_json);
  EXPECT_EQ(tail, std::vector<double>(all.begin() + 4, all.end()));
  std::filesystem::remove_all(checkpoint);
}

TEST(CliTest, TrainBadInputIsOneLineAndNeverACrash) {
  struct Case {
    std::string args;
    int exit_code;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"train --model huge", 2, "unknown model \"huge\""},
      {"train --steps 0", 2, "--steps"},
      {"train --precision fp8", 2, "fp8"},
      {"train --offload-optimizer tape", 2, "tape"},
      {"train --metrics-port 70000", 2, "--metrics-port"},
      {"train --model tiny --metrics-port 0 --metrics-address nowhere", 1, "nowhere"},
      {"train --width 12", 2, "width"},
      {"train --bogus", 2, "unknown flag --bogus"},
      {"train --device cuda --model tiny", 1, "CUDA"},
      {"train --model tiny --nvme-path /nonexistent/dir", 1, "/nonexistent/dir"},
      {"train --model tiny --device-memory 4KiB", 1, "device memory budget"},
      {"train --model tiny --resume /nonexistent/ckpt", 1, "/nonexistent/ckpt"},
      {"train --data /nonexistent/corpus.txt", 1, "/nonexistent/corpus.txt"},
      {"train --model tiny --zero-quantized-gradient-bits 3", 2,
       "placement.quantized_gradient_bits is 3; it must be 8 (int8) or 4 (int4)"},
  };
  for (const Case& c : cases) {
    auto r = RunCli(c.args);
    EXPECT_EQ(r.exit_code, c.exit_code) << c.args << ": " << r.out;
    EXPECT_NE(r.out.find(c.says), std::string::npos) << c.args << ": " << r.out;
    EXPECT_EQ(r.out.find("strata: error"), r.out.rfind("strata: error")) << c.args << ": " << r.out;
  }
}

}  // namespace
}  // namespace strata::tools
