// A tiny multi-layer perceptron and two ways to train it with AdamW: through an offload Engine
// (EngineTrainer) and with a plain in-memory loop (ReferenceTrainer). Both compute gradients
// with the same function in the same order, so any difference between them is the engine's.
#pragma once

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "device_under_test.h"
#include "strata/core/dtype.h"
#include "strata/core/host_device.h"
#include "strata/cpu_adam/cpu_optimizer.h"
#include "strata/offload/engine.h"

namespace strata::offload::testing {

/// layers x (Linear width->width, tanh except after the last), mean squared error.
class TinyModel {
 public:
  TinyModel(int layers, int width, int batch, uint64_t seed = 7)
      : layers_(layers), width_(width), batch_(batch), seed_(seed) {
    std::mt19937 random(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(float(width)));
    for (int l = 0; l < layers; ++l) {
      names_.push_back("layer" + std::to_string(l) + ".weight");
      shapes_.push_back({width, width});
      init_.emplace_back(size_t(width) * width);
      for (float& w : init_.back()) w = normal(random);
      names_.push_back("layer" + std::to_string(l) + ".bias");
      shapes_.push_back({width});
      init_.emplace_back(size_t(width), 0.01f * float(l + 1));
    }
  }

  size_t parameter_count() const { return names_.size(); }
  const std::vector<std::vector<float>>& initial_values() const { return init_; }

  /// Parameter groups as LLM recipes set them: biases without weight decay, weights at
  /// `weight_lr_scale` times the learning rate.
  void UseParameterGroups(double weight_lr_scale) {
    weight_decay_.assign(names_.size(), std::nullopt);
    lr_scale_.assign(names_.size(), 1.0);
    for (size_t p = 0; p < names_.size(); ++p) {
      if (p % 2 == 1) weight_decay_[p] = 0.0;  // Biases.
      if (p % 2 == 0) lr_scale_[p] = weight_lr_scale;
    }
  }
  /// Layers whose weight and bias are frozen (requires_grad=False).
  void FreezeLayers(const std::vector<int>& layers) {
    frozen_.assign(names_.size(), false);
    for (int l : layers) frozen_[2 * l] = frozen_[2 * l + 1] = true;
  }
  /// Which parameters are frozen, one flag each.
  std::vector<bool> frozen() const {
    return frozen_.empty() ? std::vector<bool>(names_.size(), false) : frozen_;
  }

  /// Parameter p's weight decay (unset = the optimizer's) and learning-rate scale.
  std::optional<double> weight_decay(size_t p) const {
    return weight_decay_.empty() ? std::nullopt : weight_decay_[p];
  }
  double lr_scale(size_t p) const { return lr_scale_.empty() ? 1.0 : lr_scale_[p]; }

  std::vector<ParameterSpec> Specs() const {
    std::vector<ParameterSpec> specs;
    for (size_t p = 0; p < names_.size(); ++p) {
      specs.push_back({.name = names_[p],
                       .shape = shapes_[p],
                       .initial_values = init_[p],
                       .weight_decay = weight_decay(p),
                       .lr_scale = lr_scale(p),
                       .frozen = !frozen_.empty() && frozen_[p]});
    }
    return specs;
  }

  /// Loss on micro-batch `index` and its gradients (same layout as `params`).
  double LossAndGrads(const std::vector<std::vector<float>>& params, int index,
                      std::vector<std::vector<float>>& grads) const {
    const size_t d = width_;
    const size_t b = batch_;
    std::mt19937 random(seed_ * 1000003 + index);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<std::vector<float>> acts(layers_ + 1, std::vector<float>(b * d));
    for (float& x : acts[0]) x = uniform(random);
    std::vector<float> target(b * d);
    for (float& t : target) t = 0.5f * uniform(random);

    for (int l = 0; l < layers_; ++l) {
      const std::vector<float>& w = params[2 * l];
      const std::vector<float>& bias = params[2 * l + 1];
      for (size_t r = 0; r < b; ++r) {
        for (size_t i = 0; i < d; ++i) {
          float z = bias[i];
          for (size_t j = 0; j < d; ++j) z += acts[l][r * d + j] * w[i * d + j];
          acts[l + 1][r * d + i] = l + 1 < layers_ ? std::tanh(z) : z;
        }
      }
    }
    double loss = 0.0;
    std::vector<float> upstream(b * d);
    const float norm = 1.0f / float(b * d);
    for (size_t k = 0; k < b * d; ++k) {
      const float diff = acts[layers_][k] - target[k];
      loss += double(diff) * diff * norm;
      upstream[k] = 2.0f * diff * norm;
    }
    grads.assign(params.size(), {});
    for (int l = layers_ - 1; l >= 0; --l) {
      const std::vector<float>& w = params[2 * l];
      std::vector<float>& dw = grads[2 * l];
      std::vector<float>& db = grads[2 * l + 1];
      dw.assign(d * d, 0.0f);
      db.assign(d, 0.0f);
      std::vector<float> dz(b * d);
      for (size_t k = 0; k < b * d; ++k) {
        const float a = acts[l + 1][k];
        dz[k] = l + 1 < layers_ ? upstream[k] * (1.0f - a * a) : upstream[k];
      }
      std::vector<float> down(b * d, 0.0f);
      for (size_t r = 0; r < b; ++r) {
        for (size_t i = 0; i < d; ++i) {
          const float g = dz[r * d + i];
          db[i] += g;
          for (size_t j = 0; j < d; ++j) {
            dw[i * d + j] += g * acts[l][r * d + j];
            down[r * d + j] += g * w[i * d + j];
          }
        }
      }
      upstream = std::move(down);
    }
    return loss;
  }

 private:
  int layers_;
  int width_;
  int batch_;
  uint64_t seed_;
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<std::vector<float>> init_;
  std::vector<std::optional<double>> weight_decay_;  // Empty: no groups.
  std::vector<double> lr_scale_;
  std::vector<bool> frozen_;  // Empty: none frozen.
};

/// Rounds fp32 values through `dtype` (identity for fp32).
inline void RoundThrough(DType dtype, std::vector<float>& values) {
  for (float& v : values) {
    if (dtype == DType::kBf16) v = Bf16ToFp32(Fp32ToBf16(v));
    if (dtype == DType::kFp16) v = Fp16ToFp32(Fp32ToFp16(v));
  }
}

inline void StoreAs(DType dtype, const float* in, size_t n, void* out) {
  for (size_t i = 0; i < n; ++i) {
    if (dtype == DType::kFp32) static_cast<float*>(out)[i] = in[i];
    if (dtype == DType::kBf16) static_cast<uint16_t*>(out)[i] = Fp32ToBf16(in[i]);
    if (dtype == DType::kFp16) static_cast<uint16_t*>(out)[i] = Fp32ToFp16(in[i]);
  }
}

inline float LoadAs(DType dtype, const void* in, size_t i) {
  if (dtype == DType::kBf16) return Bf16ToFp32(static_cast<const uint16_t*>(in)[i]);
  if (dtype == DType::kFp16) return Fp16ToFp32(static_cast<const uint16_t*>(in)[i]);
  return static_cast<const float*>(in)[i];
}

/// Drives an Engine the way a trainer does: forward over the chunks in order, backward in
/// reverse, GradsReady per chunk, then Step.
class EngineTrainer {
 public:
  EngineTrainer(Engine& engine, const TinyModel& model, int gradient_accumulation_steps = 1)
      : engine_(engine), model_(model), gas_(gradient_accumulation_steps) {}

  /// Backward from now on writes gradients with work queued on `stream` after `delay` (an
  /// outside trainer's stream), and names it to GradsReady and Release.
  void UseTrainerStream(OutsideStream* stream, std::chrono::milliseconds delay) {
    stream_ = stream;
    delay_ = delay;
  }
  /// Backward from now on writes gradients on the device's own compute stream (GradsReady with
  /// no stream) behind a wait of `delay` there, and calls GradsReady without waiting for them:
  /// the engine must order its copies after that stream. Micro-steps end with the stream done.
  void DelayComputeStream(std::chrono::milliseconds delay) { compute_delay_ = delay; }
  /// Chunks whose gradients backward does not produce (an unused expert): no GradsReady.
  void SetUnusedChunks(std::vector<bool> unused) { unused_ = std::move(unused); }
  /// Backward waits on the trainer thread before `chunk`'s GradsReady until `ready()` holds
  /// (polled every millisecond; empty: no wait), so that what a test needs has happened when it
  /// lands — the updates of the chunks before it started (speculation), say — however the
  /// threads run and however loaded the machine is. A condition still false after
  /// kLateChunkPatience lets the chunk land anyway, and the test's own checks then fail.
  void SetLateChunk(size_t chunk, std::function<bool()> ready) {
    late_chunk_ = chunk;
    late_ready_ = std::move(ready);
  }
  static constexpr std::chrono::seconds kLateChunkPatience{60};
  /// Backward holds `chunk` after its GradsReady, and releases it only once `ready()` holds
  /// (polled as SetLateChunk's, with the same patience): a trainer preempted between the two,
  /// or one that releases late.
  void SetHeldChunk(size_t chunk, std::function<bool()> ready) {
    held_chunk_ = chunk;
    held_ready_ = std::move(ready);
  }
  /// Backward multiplies chunk `c`'s gradients of step `step` by factor(step, c) before writing
  /// them (after the loss scale): what a trainer that edits gradients in place after
  /// GradsReady should end up with. Empty: by 1.
  void SetGradientFactor(std::function<float(int step, size_t chunk)> factor) {
    factor_ = std::move(factor);
  }

  /// One optimizer step on micro-batches [step * gas, (step + 1) * gas). `poison` sets the
  /// first gradient element to infinity (an fp16 overflow). Returns the mean micro-step loss.
  Result<StepReport> TrainStep(int step, double* loss, bool poison = false) {
    STRATA_RETURN_IF_ERROR(ForwardBackward(step, loss, poison));
    return engine_.Step().get();
  }

  /// TrainStep up to, not including, Step(): every micro-step's forward, backward and
  /// GradsReady.
  Status ForwardBackward(int step, double* loss, bool poison = false) {
    const ChunkLayout& layout = engine_.layout();
    const DType dtype = engine_.working_dtype();
    *loss = 0.0;
    for (int micro = 0; micro < gas_; ++micro) {
      std::vector<std::vector<float>> params(layout.parameter_count());
      for (size_t c = 0; c < layout.chunk_count(); ++c) {
        STRATA_ASSIGN_OR_RETURN(ChunkView view, engine_.Acquire(c));
        std::vector<std::byte> working(view.numel * DTypeSize(dtype));
        STRATA_RETURN_IF_ERROR(
            ReadDeviceMemory(engine_.device(), view.params, working.data(), working.size()));
        ForEachParameter(c, [&](size_t p, const ParameterLocation& loc) {
          params[p].resize(loc.numel);
          for (size_t i = 0; i < loc.numel; ++i) {
            params[p][i] = LoadAs(dtype, working.data(), loc.offset + i);
          }
        });
        engine_.Release(c);
      }
      std::vector<std::vector<float>> grads;
      *loss += model_.LossAndGrads(params, step * gas_ + micro, grads) / gas_;
      const float scale = float(engine_.loss_scale());
      if (poison) grads[0][0] = std::numeric_limits<float>::infinity();
      for (size_t c = layout.chunk_count(); c-- > 0;) {
        if ((c < unused_.size() && unused_[c]) || layout.chunk(c).frozen) continue;
        STRATA_ASSIGN_OR_RETURN(ChunkView view, engine_.Acquire(c));
        const float factor = factor_ ? factor_(step, c) : 1.0f;
        if (stream_ != nullptr && delay_.count() > 0) STRATA_RETURN_IF_ERROR(stream_->Sleep(delay_));
        if (stream_ == nullptr && compute_delay_.count() > 0) {
          STRATA_RETURN_IF_ERROR(engine_.device().LaunchHostFunction(
              Stream::kCompute, [delay = compute_delay_] { std::this_thread::sleep_for(delay); }));
        }
        Status written;
        ForEachParameter(c, [&](size_t p, const ParameterLocation& loc) {
          if (!written.ok()) return;
          std::vector<float> scaled = grads[p];
          for (float& g : scaled) g *= scale;
          if (factor != 1.0f) {
            for (float& g : scaled) g *= factor;
          }
          std::vector<std::byte> stored(loc.numel * DTypeSize(dtype));
          StoreAs(dtype, scaled.data(), loc.numel, stored.data());
          void* dst = static_cast<char*>(view.grads) + loc.offset * DTypeSize(dtype);
          if (stream_ != nullptr) {
            written = stream_->Write(dst, stored.data(), stored.size());
          } else if (compute_delay_.count() > 0) {
            written = QueueOnComputeStream(dst, stored);
          } else {
            written = WriteDeviceMemory(engine_.device(), dst, stored.data(), stored.size());
          }
        });
        STRATA_RETURN_IF_ERROR(written);
        const TrainerStream on{stream_ != nullptr ? stream_->native() : nullptr};
        if (c == late_chunk_ && late_ready_) WaitPatiently(late_ready_);
        STRATA_RETURN_IF_ERROR(engine_.GradsReady(c, on));
        if (c == held_chunk_ && held_ready_) WaitPatiently(held_ready_);
        engine_.Release(c, on);
      }
      if (compute_delay_.count() > 0) {
        STRATA_RETURN_IF_ERROR(engine_.device().SynchronizeStream(Stream::kCompute));
        staged_.clear();
      }
    }
    return Status();
  }

  std::vector<std::vector<float>> MasterParameters() {
    std::vector<std::vector<float>> out(engine_.layout().parameter_count());
    for (size_t p = 0; p < out.size(); ++p) {
      out[p].resize(engine_.layout().location(p).numel);
      Status s = engine_.ReadMasterParameter(p, out[p]);
      if (!s.ok()) out[p].clear();
    }
    return out;
  }

 private:
  static void WaitPatiently(const std::function<bool()>& ready) {
    const auto deadline = std::chrono::steady_clock::now() + kLateChunkPatience;
    while (!ready() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // Queues a copy of `data` to device memory `dst` on Stream::kCompute from staging memory that
  // lives until the micro-step's end; on a HostDevice, a host function there copies it in place.
  Status QueueOnComputeStream(void* dst, const std::vector<std::byte>& data) {
    Device& device = engine_.device();
    STRATA_ASSIGN_OR_RETURN(StagingBuffer staging, StagingBuffer::Create(device, data.size()));
    std::memcpy(staging.data(), data.data(), data.size());
    const std::byte* src = staging.data();
    staged_.push_back(std::move(staging));
    if (InPlace(device)) {
      return device.LaunchHostFunction(Stream::kCompute, [dst, src, bytes = data.size()] {
        std::memcpy(dst, src, bytes);
      });
    }
    return device.CopyToDevice(dst, src, data.size(), Stream::kCompute);
  }

  template <typename F>
  void ForEachParameter(size_t chunk, F&& f) {
    const ChunkInfo& info = engine_.layout().chunk(chunk);
    for (size_t p = info.first_parameter; p < info.first_parameter + info.parameter_count; ++p) {
      f(p, engine_.layout().location(p));
    }
  }

  Engine& engine_;
  const TinyModel& model_;
  int gas_;
  OutsideStream* stream_ = nullptr;
  std::chrono::milliseconds delay_{0};
  std::chrono::milliseconds compute_delay_{0};
  std::vector<StagingBuffer> staged_;  // What the compute stream still copies from.
  std::vector<bool> unused_;
  size_t late_chunk_ = 0;
  std::function<bool()> late_ready_;
  size_t held_chunk_ = 0;
  std::function<bool()> held_ready_;
  std::function<float(int, size_t)> factor_;
};

/// The same training with a plain in-memory AdamW (the cpu_adam kernel per parameter).
class ReferenceTrainer {
 public:
  ReferenceTrainer(const TinyModel& model, const EngineOptions& options)
      : model_(model), options_(options), master_(model.initial_values()), visible_(master_) {
    for (const auto& p : master_) {
      m_.emplace_back(p.size(), 0.0f);
      v_.emplace_back(p.size(), 0.0f);
    }
    optimizer_.emplace(std::move(cpu_adam::CpuOptimizer::Create({.threads = 2})).value());
  }

  /// Mirrors EngineTrainer::TrainStep; `skip` drops the step as an fp16 overflow would.
  /// Parameters marked in `unused` get no gradients: they are left out of the norm and not
  /// updated, and their own step counts stand still (torch skips a parameter without .grad);
  /// the model's frozen parameters are always unused.
  double TrainStep(int step, bool skip = false, const std::vector<bool>& unused = {}) {
    const std::vector<bool> frozen = model_.frozen();
    auto is_unused = [&](size_t p) { return (p < unused.size() && unused[p]) || frozen[p]; };
    const DType dtype = options_.precision.working_dtype;
    const int gas = options_.optimizer.gradient_accumulation_steps;
    double loss = 0.0;
    std::vector<std::vector<float>> sum;
    for (int micro = 0; micro < gas; ++micro) {
      std::vector<std::vector<float>> working = visible_;
      for (auto& p : working) RoundThrough(dtype, p);
      std::vector<std::vector<float>> grads;
      loss += model_.LossAndGrads(working, step * gas + micro, grads) / gas;
      for (auto& g : grads) RoundThrough(dtype, g);
      if (micro == 0) {
        sum = grads;
      } else {
        for (size_t p = 0; p < sum.size(); ++p) {
          for (size_t i = 0; i < sum[p].size(); ++i) sum[p][i] += grads[p][i];
        }
      }
    }
    if (skip) {
      visible_ = master_;  // What a delayed step held back went up all the same.
      return loss;
    }
    // optimizer.delayed_update: the next step computes with the parameters before this update.
    const bool delayed =
        options_.optimizer.delayed_update && step >= options_.optimizer.delayed_update_from_step;
    visible_ = master_;
    double clip = 1.0;
    if (options_.optimizer.gradient_clipping > 0.0) {
      double sq = 0.0;
      for (size_t p = 0; p < sum.size(); ++p) {
        if (is_unused(p)) continue;
        for (float x : sum[p]) sq += double(x) * x;
      }
      clip = std::min(1.0, options_.optimizer.gradient_clipping / (std::sqrt(sq) + 1e-6));
    }
    const OptimizerOptions& o = options_.optimizer;
    for (size_t p = 0; p < master_.size(); ++p) {
      if (is_unused(p)) continue;
      ++steps_[p];
      Status s = optimizer_->Step(
          cpu_adam::AdamWHyperParams{
              .lr = o.lr * model_.lr_scale(p),
              .beta1 = o.beta1,
              .beta2 = o.beta2,
              .eps = o.eps,
              .weight_decay = model_.weight_decay(p).value_or(o.weight_decay),
              .bias_correction = o.bias_correction,
              .step = steps_[p],
              .grad_scale = clip},
          cpu_adam::StepBuffers{.numel = master_[p].size(),
                                .params = master_[p].data(),
                                .grads = sum[p].data(),
                                .exp_avg = m_[p].data(),
                                .exp_avg_sq = v_[p].data()});
      if (!s.ok()) std::abort();
    }
    if (!delayed) visible_ = master_;
    return loss;
  }

  const std::vector<std::vector<float>>& master() const { return master_; }
  const std::vector<std::vector<float>>& exp_avg() const { return m_; }
  const std::vector<std::vector<float>>& exp_avg_sq() const { return v_; }
  /// The learning rate of the steps from now on.
  void SetLearningRate(double lr) { options_.optimizer.lr = lr; }

 private:
  const TinyModel& model_;
  EngineOptions options_;
  std::vector<std::vector<float>> master_, m_, v_;
  // The parameters forward and backward use: the master, or with a delayed update the master
  // one update back.
  std::vector<std::vector<float>> visible_;
  std::optional<cpu_adam::CpuOptimizer> optimizer_;
  std::vector<int64_t> steps_ = std::vector<int64_t>(model_.parameter_count(), 0);
};

}  // namespace strata::offload::testing
