// ByteLmTrainer: trains the built-in byte-level language model through an offload Engine, the
// way any trainer embeds Strata: layer by layer, acquiring the chunks that hold each layer's
// parameters, declaring each chunk's gradients ready as soon as backward is done with it.
//
// The model computes in fp32 on the host (HostDevice memory is host memory); working
// parameters of another dtype are converted per layer, gradients back. Batches are drawn from
// the training split with a generator keyed by (seed, step, micro-step), so a run resumed from
// a checkpoint sees exactly the batches an uninterrupted run would.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/device.h"
#include "strata/core/options.h"
#include "strata/core/status.h"
#include "strata/examples/byte_lm.h"
#include "strata/offload/engine.h"

namespace strata::examples {

/// Why a trainer on a non-host device is refused.
inline constexpr const char* kHostComputeOnly =
    "the built-in model computes on the host; its CUDA kernels come with the GPU issue (use "
    "--device host)";

/// A text split into training and validation bytes.
struct Corpus {
  std::vector<uint8_t> train;
  std::vector<uint8_t> validation;

  /// Reads `path` and splits it: the last 10% (from the start of the line holding byte
  /// floor(0.9 n)) is validation. NotFound/IoError naming the path; InvalidArgument when the text
  /// is too short to split.
  static Result<Corpus> Load(const std::filesystem::path& path);
  /// Entropy of the training split's byte frequencies, in nats per byte: the loss of the best
  /// model that ignores context.
  double UnigramEntropy() const;
};

/// What `strata train` sets apart from EngineOptions.
struct TrainSettings {
  ByteLmConfig model;
  int batch = 16;  ///< Sequences per micro-batch (per rank).
  int seq = 128;   ///< Predicted positions per sequence.
  uint64_t seed = 1;
  int eval_batches = 8;  ///< Validation batches per evaluation (fixed windows).
  /// Several data-parallel ranks: each micro-batch is this rank's slice [rank * batch,
  /// (rank + 1) * batch) of the ranks * batch sequences one rank with that batch would draw,
  /// so N ranks train on exactly the samples of one rank with N times the batch.
  int rank = 0;
  int ranks = 1;

  Status Validate() const;
};

/// One optimizer step as the trainer saw it.
struct TrainStepRecord {
  int64_t step = 0;              ///< Optimizer step number after it (skipped steps repeat it).
  int64_t iteration = 0;         ///< Iteration number after it, skipped steps included.
  double loss = 0.0;             ///< Mean training loss over its micro-batches, nats per byte.
  bool skipped = false;          ///< fp16 overflow.
  bool rolled_back = false;      ///< Updates made ahead of the verdict were redone or undone.
  double grad_norm = 0.0;        ///< Global L2 norm of its (unscaled) gradients; NaN if skipped.
  double loss_scale = 1.0;       ///< The scale its loss was multiplied by (fp16; 1 otherwise).
  double seconds = 0.0;          ///< Wall time of the whole step.
  double compute_seconds = 0.0;  ///< Forward and backward of the model on the trainer thread.
  double tokens_per_second = 0.0;
  offload::EngineCounters counters;  ///< Engine traffic during this step (a difference).
};

/// Not thread-safe. The device must outlive the trainer.
class ByteLmTrainer {
 public:
  /// Creates the engine for the model's parameters (initialized from settings.seed), in
  /// `environment` (with several ranks: their communicator, settings.ranks of them).
  static Result<std::unique_ptr<ByteLmTrainer>> Create(const TrainSettings& settings,
                                                       const EngineOptions& options, Device& device,
                                                       const Corpus& corpus,
                                                       offload::EngineEnvironment environment = {});

  /// Runs one optimizer step (all its micro-batches) and returns what happened.
  Result<TrainStepRecord> TrainStep();
  /// The overlapped form, for optimizer.delayed_update: runs a step's micro-batches and leaves
  /// its update running (FinishStep waits for it). A step still running from the last call
  /// updates beside this one's forward and backward; it is completed here and returned.
  Result<std::optional<TrainStepRecord>> StartStep();
  /// Waits for the step StartStep left running and returns what happened; FailedPrecondition
  /// when none is.
  Result<TrainStepRecord> FinishStep();
  /// Mean loss over `eval_batches` fixed validation windows, with the current parameters.
  Result<double> Evaluate();

  offload::Engine& engine() { return *engine_; }
  uint64_t parameter_count() const { return engine_->layout().parameter_numel(); }

 private:
  ByteLmTrainer(const TrainSettings& settings, const Corpus& corpus);
  /// Forward (and, with `grads`, backward) of one micro-batch through the engine's chunks.
  Result<double> RunMicroBatch(const std::vector<uint8_t>& tokens, bool backward);
  /// Fills `tokens` with batch windows of `split` chosen by a generator seeded with `key`:
  /// this rank's slice of them with `sliced` (training), all ranks' same ones otherwise.
  void SampleBatch(const std::vector<uint8_t>& split, uint64_t key, bool sliced,
                   std::vector<uint8_t>& tokens);

  TrainSettings settings_;
  const Corpus& corpus_;
  std::unique_ptr<offload::Engine> engine_;
  ByteLm model_;
  std::vector<ParameterInfo> parameters_;
  std::vector<std::vector<size_t>> layer_parameters_;  // Parameter indices of each layer.
  std::vector<std::vector<size_t>> layer_chunks_;      // Chunks each layer touches.
  std::vector<int> chunk_first_layer_, chunk_last_layer_;
  std::vector<std::vector<float>> scratch_params_, scratch_grads_;  // fp32, per parameter.
  int micro_steps_ = 1;                                             // gradient_accumulation_steps
  // The step StartStep left updating: its record so far, and the engine's report to come.
  struct Running {
    TrainStepRecord record;
    int64_t iteration = 0;  // The engine's iteration count once it completes.
    std::future<Result<offload::StepReport>> report;
    std::chrono::steady_clock::time_point start;
    offload::EngineCounters before;
  };
  std::optional<Running> running_;
  std::chrono::steady_clock::time_point completed_at_;  // When Complete last completed one,
  offload::EngineCounters completed_counters_;          // and the engine's counters then.
  /// Completes `running_`'s record with its report and clears it.
  Result<TrainStepRecord> Complete();
};

}  // namespace strata::examples
