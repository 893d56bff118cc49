#include "strata/examples/byte_lm_trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <set>

#include "strata/core/dtype.h"
#include "strata/core/input_file.h"

namespace strata::examples {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// A 64-bit mix of the keys, so that every (seed, step, micro-step) draws its own batch.
uint64_t MixKey(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
               (c + 1) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x * 0xD6E8FEB86659FD93ull;
}

}  // namespace

Result<Corpus> Corpus::Load(const std::filesystem::path& path) {
  STRATA_ASSIGN_OR_RETURN(const std::string data, ReadInputFile(path.string(), kCorpusInput));
  if (data.size() < 4096) {
    return InvalidArgument("the corpus " + path.string() + " has " + std::to_string(data.size()) +
                           " bytes; at least 4096 are needed to split it");
  }
  // The last 10%, from the start of the line holding byte floor(0.9 n), is validation.
  const size_t mark = data.size() / 10 * 9;
  size_t cut = mark;
  while (cut > 0 && data[cut - 1] != '\n') --cut;
  if (cut == 0) cut = mark;
  Corpus corpus;
  corpus.train.assign(data.begin(), data.begin() + cut);
  corpus.validation.assign(data.begin() + cut, data.end());
  return corpus;
}

double Corpus::UnigramEntropy() const {
  double counts[256] = {};
  for (uint8_t b : train) counts[b] += 1.0;
  double entropy = 0.0;
  for (double c : counts) {
    if (c > 0) entropy -= c / train.size() * std::log(c / train.size());
  }
  return entropy;
}

Status TrainSettings::Validate() const {
  STRATA_RETURN_IF_ERROR(model.Validate());
  if (batch < 1 || batch > 65536) {
    return InvalidArgument("--batch must be in [1, 65536], got " + std::to_string(batch));
  }
  if (seq < 1 || seq > 65536) {
    return InvalidArgument("--seq must be in [1, 65536], got " + std::to_string(seq));
  }
  if (eval_batches < 1) return InvalidArgument("eval_batches must be >= 1");
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    return InvalidArgument("rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                           " is not a rank");
  }
  return Status();
}

ByteLmTrainer::ByteLmTrainer(const TrainSettings& settings, const Corpus& corpus)
    : settings_(settings), corpus_(corpus), model_(settings.model) {}

Result<std::unique_ptr<ByteLmTrainer>> ByteLmTrainer::Create(
    const TrainSettings& settings, const EngineOptions& options, Device& device,
    const Corpus& corpus, offload::EngineEnvironment environment) {
  STRATA_RETURN_IF_ERROR(settings.Validate());
  const size_t window = size_t(settings.seq) + 1;
  if (corpus.train.size() < window || corpus.validation.size() < window) {
    return InvalidArgument("--seq " + std::to_string(settings.seq) +
                           " is longer than the corpus' validation split (" +
                           std::to_string(corpus.validation.size()) + " bytes)");
  }
  if (device.properties().kind != DeviceKind::kHost) {
    return Unavailable(kHostComputeOnly);
  }
  std::unique_ptr<ByteLmTrainer> trainer(new ByteLmTrainer(settings, corpus));
  trainer->micro_steps_ = options.optimizer.gradient_accumulation_steps;
  trainer->parameters_ = ByteLmParameters(settings.model);
  const std::vector<std::vector<float>> initial =
      InitByteLmParameters(settings.model, settings.seed);
  std::vector<offload::ParameterSpec> specs;
  for (size_t p = 0; p < trainer->parameters_.size(); ++p) {
    specs.push_back({trainer->parameters_[p].name, trainer->parameters_[p].shape, initial[p]});
  }
  STRATA_ASSIGN_OR_RETURN(trainer->engine_,
                          offload::Engine::Create(options, device, specs, std::move(environment)));

  // Which chunks each layer needs, and the first and last layer of each chunk.
  const offload::ChunkLayout& layout = trainer->engine_->layout();
  const int layers = ByteLmLayerCount(settings.model);
  trainer->layer_parameters_.resize(layers);
  trainer->layer_chunks_.resize(layers);
  trainer->chunk_first_layer_.assign(layout.chunk_count(), layers);
  trainer->chunk_last_layer_.assign(layout.chunk_count(), -1);
  for (size_t p = 0; p < trainer->parameters_.size(); ++p) {
    const int layer = trainer->parameters_[p].layer;
    const size_t chunk = layout.location(p).chunk;
    trainer->layer_parameters_[layer].push_back(p);
    auto& chunks = trainer->layer_chunks_[layer];
    if (std::find(chunks.begin(), chunks.end(), chunk) == chunks.end()) chunks.push_back(chunk);
    trainer->chunk_first_layer_[chunk] = std::min(trainer->chunk_first_layer_[chunk], layer);
    trainer->chunk_last_layer_[chunk] = std::max(trainer->chunk_last_layer_[chunk], layer);
  }
  return trainer;
}

void ByteLmTrainer::SampleBatch(const std::vector<uint8_t>& split, uint64_t key, bool sliced,
                                std::vector<uint8_t>& tokens) {
  const size_t window = size_t(settings_.seq) + 1;
  std::mt19937_64 random(key);
  std::uniform_int_distribution<size_t> start(0, split.size() - window);
  tokens.resize(size_t(settings_.batch) * window);
  // The draws of the ranks before this one are theirs.
  const int skip = sliced ? settings_.rank * settings_.batch : 0;
  for (int b = 0; b < skip; ++b) start(random);
  for (int b = 0; b < settings_.batch; ++b) {
    const size_t s = start(random);
    std::copy(split.begin() + s, split.begin() + s + window, tokens.begin() + b * window);
  }
}

Result<double> ByteLmTrainer::RunMicroBatch(const std::vector<uint8_t>& tokens, bool backward) {
  offload::Engine& engine = *engine_;
  const offload::ChunkLayout& layout = engine.layout();
  const DType dtype = engine.working_dtype();
  const size_t element = DTypeSize(dtype);
  const int layers = ByteLmLayerCount(settings_.model);
  STRATA_RETURN_IF_ERROR(model_.Begin(tokens, settings_.batch, settings_.seq));

  std::vector<offload::ChunkView> views(layout.chunk_count());
  std::vector<bool> held(layout.chunk_count(), false);
  auto acquire_layer = [&](int layer) -> Status {
    for (size_t c : layer_chunks_[layer]) {
      if (held[c]) continue;
      STRATA_ASSIGN_OR_RETURN(views[c], engine.Acquire(c));
      held[c] = true;
    }
    return Status();
  };
  auto release_all = [&] {
    for (size_t c = 0; c < held.size(); ++c) {
      if (held[c]) engine.Release(c);
    }
  };
  // fp32 views of a layer's parameters: the chunk memory itself for fp32, converted otherwise.
  auto layer_params = [&](int layer, std::vector<std::span<const float>>& spans) {
    spans.clear();
    const auto& indices = layer_parameters_[layer];
    scratch_params_.resize(std::max(scratch_params_.size(), indices.size()));
    for (size_t k = 0; k < indices.size(); ++k) {
      const offload::ParameterLocation& loc = layout.location(indices[k]);
      const char* data = static_cast<const char*>(views[loc.chunk].params) + loc.offset * element;
      if (dtype == DType::kFp32) {
        spans.emplace_back(reinterpret_cast<const float*>(data), loc.numel);
        continue;
      }
      std::vector<float>& out = scratch_params_[k];
      out.resize(loc.numel);
      const auto* bits = reinterpret_cast<const uint16_t*>(data);
      if (dtype == DType::kBf16) {
        Bf16ToFp32({bits, loc.numel}, out);
      } else {
        Fp16ToFp32({bits, loc.numel}, out);
      }
      spans.emplace_back(out);
    }
  };

  double loss = 0.0;
  std::vector<std::span<const float>> params;
  for (int layer = 0; layer < layers; ++layer) {
    Status acquired = acquire_layer(layer);
    if (!acquired.ok()) {
      release_all();
      return acquired;
    }
    layer_params(layer, params);
    Result<double> result = model_.Forward(layer, params);
    if (!result.ok()) {
      release_all();
      return result.status();
    }
    loss = *result;
    for (size_t c : layer_chunks_[layer]) {
      // Forward is done with a chunk after its last layer, unless backward starts right here.
      if (held[c] && chunk_last_layer_[c] == layer && !(backward && layer == layers - 1)) {
        engine.Release(c);
        held[c] = false;
      }
    }
  }
  if (!backward) {
    release_all();
    return loss;
  }

  const float loss_scale = float(engine.loss_scale());
  std::vector<std::span<float>> grads;
  for (int layer = layers - 1; layer >= 0; --layer) {
    Status status = acquire_layer(layer);
    if (status.ok()) {
      layer_params(layer, params);
      const auto& indices = layer_parameters_[layer];
      scratch_grads_.resize(std::max(scratch_grads_.size(), indices.size()));
      grads.clear();
      for (size_t k = 0; k < indices.size(); ++k) {
        const offload::ParameterLocation& loc = layout.location(indices[k]);
        char* data = static_cast<char*>(views[loc.chunk].grads) + loc.offset * element;
        if (dtype == DType::kFp32) {
          grads.emplace_back(reinterpret_cast<float*>(data), loc.numel);
        } else {
          scratch_grads_[k].resize(loc.numel);
          grads.emplace_back(scratch_grads_[k]);
        }
      }
      status = model_.Backward(layer, params, grads, loss_scale);
    }
    if (status.ok() && dtype != DType::kFp32) {
      const auto& indices = layer_parameters_[layer];
      for (size_t k = 0; k < indices.size(); ++k) {
        const offload::ParameterLocation& loc = layout.location(indices[k]);
        auto* bits = reinterpret_cast<uint16_t*>(static_cast<char*>(views[loc.chunk].grads) +
                                                 loc.offset * element);
        if (dtype == DType::kBf16) {
          Fp32ToBf16(scratch_grads_[k], {bits, loc.numel});
        } else {
          Fp32ToFp16(scratch_grads_[k], {bits, loc.numel});
        }
      }
    }
    // Backward is done with a chunk after its first layer: its gradients can leave now.
    for (size_t c : layer_chunks_[layer]) {
      if (!status.ok() || !held[c] || chunk_first_layer_[c] != layer) continue;
      status = engine.GradsReady(c);
      engine.Release(c);
      held[c] = false;
    }
    if (!status.ok()) {
      release_all();
      return status;
    }
  }
  return loss;
}

Result<TrainStepRecord> ByteLmTrainer::TrainStep() {
  STRATA_ASSIGN_OR_RETURN(std::optional<TrainStepRecord> before, StartStep());
  if (before) return Internal("TrainStep after StartStep: call FinishStep first");
  return FinishStep();
}

Result<std::optional<TrainStepRecord>> ByteLmTrainer::StartStep() {
  // Each iteration has a batch of its own, skipped (fp16 overflow) ones included, as a data
  // loader that advances every iteration gives; one still updating counts.
  const int64_t iteration = running_ ? running_->iteration + 1 : engine_->iteration_count() + 1;
  Running step{.iteration = iteration, .start = Clock::now(), .before = engine_->counters()};
  const int micro_steps = micro_steps_;
  TrainStepRecord& record = step.record;
  std::vector<uint8_t> tokens;
  for (int micro = 0; micro < micro_steps; ++micro) {
    SampleBatch(corpus_.train, MixKey(settings_.seed, uint64_t(iteration), uint64_t(micro)),
                /*sliced=*/true, tokens);
    const auto compute_start = Clock::now();
    // With a step still updating, the first GradsReady waits for it; its loss scale is this
    // step's (delayed updates keep it fixed).
    if (micro == 0) record.loss_scale = engine_->loss_scale();
    STRATA_ASSIGN_OR_RETURN(double loss, RunMicroBatch(tokens, /*backward=*/true));
    record.compute_seconds += SecondsSince(compute_start);
    record.loss += loss / micro_steps;
  }
  std::optional<TrainStepRecord> completed;
  if (running_) {
    STRATA_ASSIGN_OR_RETURN(completed, Complete());
    // Its update ran beside this forward and backward: each step's time and traffic is what
    // passed since the one before it completed.
    step.start = completed_at_;
    step.before = completed_counters_;
  }
  step.report = engine_->Step();
  running_ = std::move(step);
  return completed;
}

Result<TrainStepRecord> ByteLmTrainer::FinishStep() {
  if (!running_) return FailedPrecondition("FinishStep without a step StartStep left running");
  return Complete();
}

Result<TrainStepRecord> ByteLmTrainer::Complete() {
  Running step = std::move(*running_);
  running_.reset();
  STRATA_ASSIGN_OR_RETURN(offload::StepReport report, step.report.get());
  TrainStepRecord& record = step.record;
  record.step = report.step;
  record.iteration = report.iteration;
  record.skipped = report.skipped;
  record.rolled_back = report.rolled_back;
  record.grad_norm = report.grad_norm;
  completed_at_ = Clock::now();
  completed_counters_ = engine_->counters();
  record.seconds = std::chrono::duration<double>(completed_at_ - step.start).count();
  // The ranks' tokens together: what one rank with all of their batch would count.
  record.tokens_per_second =
      double(settings_.batch) * settings_.ranks * settings_.seq * micro_steps_ / record.seconds;
  record.counters = completed_counters_ - step.before;
  return record;
}

Result<double> ByteLmTrainer::Evaluate() {
  std::vector<uint8_t> tokens;
  double total = 0.0;
  for (int b = 0; b < settings_.eval_batches; ++b) {
    // Fixed windows: the same validation batches at every evaluation.
    SampleBatch(corpus_.validation, MixKey(settings_.seed ^ 0xEEull, ~0ull, uint64_t(b)),
                /*sliced=*/false, tokens);
    STRATA_ASSIGN_OR_RETURN(double loss, RunMicroBatch(tokens, /*backward=*/false));
    total += loss;
  }
  return total / settings_.eval_batches;
}

}  // namespace strata::examples
