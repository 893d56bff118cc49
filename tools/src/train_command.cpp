// `strata train`: the built-in byte-level language model trained through the offload engine on
// the shipped corpus. Its defaults are the demo: optimizer states on NVMe in a temporary
// folder, parameters offloaded to host memory, and a device budget a fraction of the model.
// This file is the command and its loop; train_setup.h makes the options, train_report.h
// reports.
#include <signal.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "interrupt.h"
#include "launcher.h"
#include "metrics_server.h"
#include "scratch_dir.h"
#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/core/host_device.h"
#include "strata/core/log.h"
#include "strata/examples/byte_lm_trainer.h"
#include "strata/offload/mpi_communicator.h"
#include "strata/offload/ranks.h"
#include "train_flags.h"
#include "train_report.h"
#include "train_setup.h"

namespace strata::tools {
namespace {

using examples::ByteLmTrainer;
using examples::Corpus;
using examples::TrainSettings;
using examples::TrainStepRecord;

constexpr const char* kCommand = "strata train";

int Train(const TrainFlags& f) {
  // Started as one of several ranks (mpirun, srun): the ranks train one model, each keeping its
  // shard of the optimizer states (ZeRO stages 1 and 2; with stage 3 of the parameters too) and
  // its slice of every batch; rank 0 prints, and every rank's errors say which rank it is.
  Result<offload::RankInfo> ranks = offload::DetectRanks();
  if (!ranks.ok()) return Fail(kExitUsage, ranks.status().message(), kCommand);
  const offload::RankInfo launched = *ranks;
  const bool several = launched.size > 1;
  const bool prints = launched.rank == 0;
  auto fail = [&](int code, const std::string& message, const std::string& command = "") {
    return Fail(code,
                several ? "rank " + std::to_string(launched.rank) + " of " +
                              std::to_string(launched.size) + ": " + message
                        : message,
                command);
  };
  if (Status s = CheckLaunchable(launched); !s.ok()) return fail(kExitFailure, s.message());
  if (f.metrics_port != kNotGiven && (f.metrics_port < 0 || f.metrics_port > 65535)) {
    return fail(kExitUsage,
                "--metrics-port must be in [0, 65535] (0: any free port), got " +
                    std::to_string(f.metrics_port),
                kCommand);
  }
  auto model = ModelConfig(f);
  if (!model.ok()) return fail(kExitUsage, model.status().message(), kCommand);
  if (f.steps < 1 || f.steps > 10'000'000) {
    return fail(kExitUsage, "--steps must be in [1, 10000000]", kCommand);
  }
  if (f.checkpoint_every < 0) return fail(kExitUsage, "--checkpoint-every must be >= 0", kCommand);

  // A config file's content errors exit as `strata config check` does (docs/cli.md's table).
  std::optional<LoadedConfig> config;
  if (!f.config.empty()) {
    // A DeepSpeed config's batch sizes count every rank (train_batch_size).
    Result<LoadedConfig> loaded = LoadConfigFile(f.config, ConfigFormat::kAuto, launched.size);
    if (!loaded.ok()) return fail(kExitFailure, loaded.status().message());
    if (!loaded->ignored_keys.empty()) Log(LogLevel::kWarning, IgnoredKeysWarning(*loaded));
    config = std::move(loaded).value();
  }
  // The micro-batch: --batch, else the config's (DeepSpeed's train_micro_batch_size_per_gpu,
  // given or derived), else 8.
  int64_t batch = f.batch;
  const bool batch_from_config = batch == -1 && config && config->micro_batch_size;
  if (batch == -1) batch = batch_from_config ? *config->micro_batch_size : 8;
  // A config's batch out of what the model takes is the config's error (exit 1, as check's
  // content errors), not the command line's. 65536 is TrainSettings::Validate's limit.
  if (batch_from_config && batch > 65536) {
    return fail(kExitFailure, f.config + ": train_micro_batch_size_per_gpu " +
                                  std::to_string(batch) +
                                  " (given or derived) is more sequences per micro-batch than "
                                  "strata train takes (1 to 65536); lower it, or pass --batch");
  }
  TrainSettings settings{.model = *model,
                         .batch = int(std::clamp<int64_t>(batch, -1, 1 << 30)),
                         .seq = int(std::clamp<int64_t>(f.seq, -1, 1 << 30)),
                         .seed = uint64_t(f.seed)};
  if (Status s = settings.Validate(); !s.ok()) return fail(kExitUsage, s.message(), kCommand);

  auto corpus = Corpus::Load(f.data);
  if (!corpus.ok()) return fail(kExitFailure, corpus.status().message());
  // SIGINT and SIGTERM end the run after the step in flight (interrupt.h); installed before
  // anything is created, so that a signal during teardown ends it at once, not half-way.
  const InterruptHandlers interrupts;
  ScratchDir scratch;
  auto options = EngineOptionsFor(f, config, scratch, *model, launched.size);
  if (!options.ok()) return fail(kExitUsage, options.status().message(), kCommand);
  if (Status s = CheckCheckpointApart(f.checkpoint, options->nvme.paths, f.data); !s.ok()) {
    return fail(kExitFailure, s.message());
  }
  if (options->device.kind == DeviceKind::kCuda) {
    return fail(kExitFailure, examples::kHostComputeOnly);
  }
  auto device =
      CreateHostDevice({.memory_budget_bytes = options->device.host_device_memory_bytes,
                        .copy_bytes_per_second = options->device.copy_bandwidth_gbps * 1e9});
  if (!device.ok()) return fail(kExitFailure, device.status().message());
  // Several ranks: one communicator for the engine's collectives and one for this command's
  // own (the mean loss, the peaks); both run on the MPI thread in the order enqueued.
  offload::EngineEnvironment environment;
  std::unique_ptr<offload::Communicator> scalars;
  if (several) {
    const offload::MpiCommunicatorOptions mpi{.timeout_seconds =
                                                  options->placement.collective_timeout_seconds};
    auto engine_comm = ConnectLaunchedRanks(launched, mpi);
    if (!engine_comm.ok()) return fail(kExitFailure, engine_comm.status().message());
    auto own = ConnectLaunchedRanks(launched, mpi);
    if (!own.ok()) return fail(kExitFailure, own.status().message());
    environment.communicator = std::move(*engine_comm);
    scalars = std::move(*own);
    settings.rank = launched.rank;
    settings.ranks = launched.size;
  }
  auto trainer =
      ByteLmTrainer::Create(settings, *options, **device, *corpus, std::move(environment));
  if (!trainer.ok()) return fail(kExitFailure, trainer.status().message());
  offload::Engine& engine = (*trainer)->engine();
  // A run that cannot save fails now, not after its last step.
  if (!f.checkpoint.empty()) {
    if (Status s = engine.CheckSaveTarget(f.checkpoint); !s.ok()) {
      return fail(kExitFailure, "--checkpoint " + f.checkpoint + ": " + s.message());
    }
  }
  if (!f.resume.empty()) {
    if (Status s = engine.Load(f.resume); !s.ok()) {
      return fail(kExitFailure, "resuming from " + f.resume + ": " + s.message());
    }
  }

  const TrainGauges gauges(engine.metrics());
  std::unique_ptr<MetricsServer> server;
  if (f.metrics_port >= 0 && prints) {
    auto started = ServeMetrics(f, engine, gauges, *options);
    if (!started.ok()) return fail(kExitFailure, started.status().message());
    server = std::move(started).value();
    std::fprintf(stderr, "strata train: metrics on http://%s:%u/metrics and /status\n",
                 f.metrics_address.c_str(), unsigned(server->port()));
  }

  RunSummary summary;
  summary.unigram_entropy = corpus->UnigramEntropy();
  summary.ranks = launched.size;
  if (!f.json && prints) {
    std::printf(
        "strata train: %s model, %s params; optimizer states on %s, parameters on %s; "
        "%lld steps of %d x %d x %d bytes (micro-batches x sequences x length); lr %g; loss "
        "scale %g\n",
        f.model.c_str(), FormatCount((*trainer)->parameter_count()).c_str(),
        StatesPlacement(engine).c_str(), std::string(TierName(options->placement.params)).c_str(),
        static_cast<long long>(f.steps), options->optimizer.gradient_accumulation_steps,
        settings.batch, settings.seq, options->optimizer.lr, engine.loss_scale());
  }
  // The signal that stops the run, once every rank knows of it.
  int stop_signal = 0;
  int64_t saved_step = -1;  // The step of the last checkpoint this run saved.
  // Iterations, as DeepSpeed counts them: an fp16 step skipped for overflow is one too, so a run
  // whose every step overflows (a fixed loss scale far too high) still ends.
  // `idle`: no step is running, so a checkpoint or an evaluation may follow.
  auto report = [&](TrainStepRecord r, bool last, bool idle) -> Status {
    const int received = InterruptHandlers::received();
    if (scalars) {
      // The loss of the whole batch: the mean of the ranks' slices; and whether any rank was
      // signalled, so that all stop after this same step.
      std::array<double, 2> sums = {r.loss, received != 0 ? 1.0 : 0.0};
      STRATA_RETURN_IF_ERROR(scalars->AllReduceNow(sums, offload::ReduceOp::kSum)
                                 .WithContext("averaging the loss across ranks"));
      r.loss = sums[0] / launched.size;
      if (sums[1] > 0) stop_signal = received != 0 ? received : SIGTERM;
    } else {
      stop_signal = received;
    }
    summary.records.push_back(r);
    gauges.step->Set(double(r.step));
    gauges.loss->Set(r.loss);
    gauges.tokens_per_second->Set(r.tokens_per_second);
    gauges.step_seconds->Set(r.seconds);
    if (!f.json && prints) {
      std::printf("step %5lld  loss %.4f%s  %8.0f tok/s  %6.3f s  d2h %s  h2d %s  nvme r %s w %s\n",
                  static_cast<long long>(r.step), r.loss, r.skipped ? " (skipped)" : "",
                  r.tokens_per_second, r.seconds,
                  FormatBytes(r.counters.device_to_host_bytes).c_str(),
                  FormatBytes(r.counters.host_to_device_bytes).c_str(),
                  FormatBytes(r.counters.nvme_read_bytes).c_str(),
                  FormatBytes(r.counters.nvme_write_bytes).c_str());
      std::fflush(stdout);
    }
    if (!idle) return Status();
    if (!f.checkpoint.empty() &&
        (last || (f.checkpoint_every > 0 && r.step % f.checkpoint_every == 0 && !r.skipped))) {
      if (Status s = engine.Save(f.checkpoint); !s.ok()) {
        return s.WithContext("saving the checkpoint");
      }
      saved_step = r.step;
    }
    if (!f.json && f.eval_every > 0 && r.step % f.eval_every == 0 && !last) {
      // Every rank evaluates (the same parameters, the same batches): the ranks stay in step,
      // so that rank 0's evaluation does not count against the others' collective timeout.
      STRATA_ASSIGN_OR_RETURN(double loss, (*trainer)->Evaluate());
      gauges.validation_loss->Set(loss);
      if (prints) std::printf("           validation loss %.4f\n", loss);
    }
    return Status();
  };
  // With delayed updates each step is left updating while the next one's forward and backward
  // run, except a step that a checkpoint or an evaluation follows: those need it complete.
  const bool overlap = options->optimizer.delayed_update;
  int64_t iteration = engine.iteration_count();
  bool in_flight = false;  // A delayed update's step started and not yet finished.
  while (iteration < f.steps) {
    // One rank alone may stop at once; several stop as they agreed in `report`.
    if (!several && stop_signal == 0) stop_signal = InterruptHandlers::received();
    if (stop_signal != 0) break;
    const int64_t number = ++iteration;
    const bool last = number >= f.steps;
    const bool pause =
        last ||
        (!f.checkpoint.empty() && f.checkpoint_every > 0 && number % f.checkpoint_every == 0) ||
        (!f.json && f.eval_every > 0 && number % f.eval_every == 0);
    auto before = (*trainer)->StartStep();
    if (!before.ok()) return fail(kExitFailure, before.status().message());
    if (*before) {
      // The step before, completed beside this one: no checkpoint or evaluation falls on it.
      if (Status s = report(**before, /*last=*/false, /*idle=*/false); !s.ok()) {
        return fail(kExitFailure, s.message());
      }
    }
    in_flight = true;
    if (overlap && !pause) continue;
    auto record = (*trainer)->FinishStep();
    in_flight = false;
    if (!record.ok()) return fail(kExitFailure, record.status().message());
    if (Status s = report(*record, last, /*idle=*/true); !s.ok()) {
      return fail(kExitFailure, s.message());
    }
  }
  if (stop_signal != 0) {
    // Finish the step in flight, so that its update is not left half applied, then go.
    if (in_flight) {
      auto record = (*trainer)->FinishStep();
      if (!record.ok()) return fail(kExitFailure, record.status().message());
      if (Status s = report(*record, /*last=*/false, /*idle=*/false); !s.ok()) {
        return fail(kExitFailure, s.message());
      }
    }
    if (prints) {
      const std::string saved = saved_step >= 0 ? "the last checkpoint is " + f.checkpoint +
                                                      " (step " + std::to_string(saved_step) + ")"
                                : f.checkpoint.empty()
                                    ? std::string(
                                          "no checkpoint was saved (--checkpoint DIR "
                                          "--checkpoint-every K keeps progress)")
                                    : "no checkpoint was saved by this run";
      std::fprintf(
          stderr, "strata train: interrupted by %s after step %lld; %s\n", SignalName(stop_signal),
          static_cast<long long>(summary.records.empty() ? 0 : summary.records.back().step),
          saved.c_str());
    }
    // The swap files and the scratch folder go now; under mpirun the ranks then wait for each
    // other, since the launcher ends every rank as soon as one exits.
    server.reset();
    trainer->reset();
    scratch.Remove();
    if (scalars) {
      std::array<double, 1> done = {0.0};
      scalars->AllReduceNow(done, offload::ReduceOp::kSum).IgnoreError();
    }
    return InterruptedExitCode(stop_signal);
  }
  for (Tier tier : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    summary.peak_bytes[size_t(tier)] = engine.tier_usage(tier).peak_bytes;
  }
  if (scalars) {
    std::array<double, 3> peaks;
    for (size_t i = 0; i < peaks.size(); ++i) peaks[i] = double(summary.peak_bytes[i]);
    if (Status s = scalars->AllReduceNow(peaks, offload::ReduceOp::kMax); !s.ok()) {
      return fail(kExitFailure, s.WithContext("gathering the ranks' peaks").message());
    }
    for (size_t i = 0; i < peaks.size(); ++i) summary.peak_bytes[i] = uint64_t(peaks[i]);
  }
  // Every rank evaluates, as during training: with stage 3 each Acquire gathers the chunk's
  // parameters from every rank.
  auto validation = (*trainer)->Evaluate();
  if (!validation.ok()) return fail(kExitFailure, validation.status().message());
  if (!prints) return kExitOk;
  summary.validation_loss = *validation;
  gauges.validation_loss->Set(*validation);
  if (f.json) {
    std::cout << ToJson(f, settings, *model, *options, **trainer, summary).dump(2) << "\n";
  } else {
    PrintSummary(f, *options, **trainer, summary);
  }
  return kExitOk;
}

}  // namespace

int RunTrain(const std::vector<std::string>& args) {
  TrainFlags f;
  FlagParser flags(kCommand,
                   "Train the built-in byte-level language model on the shipped corpus through "
                   "the offload engine (defaults: optimizer states on NVMe in a temporary "
                   "folder, parameters offloaded to host, a device budget of three chunks).");
  flags.AddString("config", &f.config, "FILE", "Strata or DeepSpeed JSON config; flags override");
  flags.AddString("model", &f.model, "NAME", "tiny, small (default) or medium");
  flags.AddInt("layers", &f.layers, "residual blocks (overrides the model's)");
  flags.AddInt("width", &f.width, "model width, a multiple of 8 (overrides the model's)");
  flags.AddInt("context", &f.context, "bytes of context per position (overrides the model's)");
  flags.AddInt("steps", &f.steps,
               "total iterations, counting resumed ones and fp16 steps skipped for overflow, "
               "as DeepSpeed does (default 150)");
  flags.AddInt("batch", &f.batch,
               "sequences per micro-batch (default: the config's "
               "train_micro_batch_size_per_gpu, else 8)");
  flags.AddInt("seq", &f.seq, "bytes predicted per sequence (default 128)");
  flags.AddDouble("lr", &f.lr,
                  "learning rate (default: the config's optimizer section's, else 2e-3)");
  flags.AddString("offload-optimizer", &f.offload_optimizer, "TIER",
                  "optimizer states: device, host or nvme (default nvme)");
  flags.AddString("offload-params", &f.offload_params, "TIER",
                  "working parameters: device, host (default) or nvme");
  flags.AddString("nvme-path", &f.nvme_path, "DIR",
                  "NVMe swap folder (default: a new one under $TMPDIR or /tmp)");
  flags.AddString("device", &f.device, "KIND", "host (default) or cuda");
  flags.AddBytes("device-memory", &f.device_memory,
                 "device memory budget (default: 3 chunks with offloaded parameters)");
  flags.AddBytes("host-memory", &f.host_memory, "pinned host memory budget (default: automatic)");
  flags.AddBytes("max-states-in-host", &f.max_states_in_host,
                 "with --offload-optimizer nvme: this much of the states (the first chunks) in "
                 "host memory instead, the rest on NVMe");
  flags.AddBytes("chunk-size", &f.chunk_size,
                 "working parameters per chunk (default 288KiB: one block of the small model)");
  flags.AddString("precision", &f.precision, "DTYPE", "bf16 (default), fp16 or fp32");
  flags.AddInt("metrics-port", &f.metrics_port,
               "serve Prometheus /metrics and JSON /status on this port while training (0: any)");
  flags.AddString("metrics-address", &f.metrics_address, "ADDR",
                  "interface for --metrics-port (default 127.0.0.1)");
  flags.AddString("checkpoint", &f.checkpoint, "DIR",
                  "save a checkpoint here (at the end); under mpirun or srun every rank saves "
                  "its shards into it, so it must be on a file system the ranks share");
  flags.AddInt("checkpoint-every", &f.checkpoint_every, "also save every K steps");
  flags.AddString("resume", &f.resume, "DIR",
                  "continue from a checkpoint, saved by any number of ranks");
  flags.AddInt("seed", &f.seed, "initialization and data seed (default 1)");
  flags.AddDouble("collective-timeout", &f.collective_timeout,
                  "under mpirun or srun: seconds a collective waits for the other ranks before "
                  "the step fails (placement.collective_timeout_seconds, default 600)");
  flags.AddInt("zero-stage", &f.zero_stage,
               "under mpirun or srun: 1 or 2 shards the optimizer states across the ranks, 3 "
               "the parameters too (each rank keeps its shard in host memory) (default: the "
               "config's, else 2); --batch is per rank");
  flags.AddBool("zero-quantized-weights", &f.zero_quantized_weights,
                "ZeRO++: stage 3 gathers parameters as blockwise int8, about half of bf16's "
                "bytes (zero_optimization.zero_quantized_weights)");
  flags.AddBool("zero-quantized-gradients", &f.zero_quantized_gradients,
                "ZeRO++: stage 3 reduces gradients as blockwise integers, int8 a quarter of "
                "fp32's bytes (zero_optimization.zero_quantized_gradients)");
  flags.AddInt("zero-quantized-gradient-bits", &f.zero_quantized_gradient_bits,
               "width of quantized gradients: 8 (default) or 4, DeepSpeed's qgZ width, an "
               "eighth of fp32's bytes (placement.quantized_gradient_bits)");
  flags.AddInt("eval-every", &f.eval_every, "print the validation loss every K steps (default 50)");
  flags.AddString("data", &f.data, "FILE", "training text (default: the shipped corpus)");
  flags.AddBool("json", &f.json, "print one JSON document instead of progress and a table");
  flags.AddBool("delayed-update", &f.delayed_update,
                "delayed parameter update (ZeRO-Offload's DPU): each step's CPU update runs "
                "beside the next step's forward and backward, which use parameters one update "
                "old (needs --offload-params device)");
  flags.AddInt("delayed-update-from", &f.delayed_update_from,
               "the first step whose update is delayed (default 40)");
  if (const std::optional<int> done = ParseFlags(flags, args, kCommand)) return *done;
  return Train(f);
}

}  // namespace strata::tools
