// What the sharded-engine tests share: a model whose parameters straddle shards, the ranks'
// gradients (exact in fp32 in any summation order), a trainer's step and the options.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine_test_support.h"
#include "strata/nvme/fault_injection.h"

namespace strata::offload::testing {

constexpr uint64_t kShardedChunkBytes = 16 * 1024;  // 4096 fp32 elements: several chunks.

/// Parameters of odd sizes that straddle shard boundaries, two parameter groups (biases without
/// weight decay, a head at half the learning rate) and a frozen one.
struct ShardedModel {
  std::vector<std::vector<float>> values;
  std::vector<ParameterSpec> specs;

  ShardedModel() {
    // Chunks of 2624, 3570 and 2560 elements (4096 each, padded for two ranks) and a frozen
    // one.
    const std::vector<std::vector<int64_t>> shapes = {{40, 64}, {64},     {50, 70},
                                                      {70},     {40, 64}, {300}};
    for (size_t p = 0; p < shapes.size(); ++p) {
      size_t numel = 1;
      for (int64_t d : shapes[p]) numel *= size_t(d);
      std::vector<float> v(numel);
      for (size_t i = 0; i < numel; ++i) v[i] = float(int((p * 31 + i * 7) % 41) - 20) / 64.0f;
      values.push_back(std::move(v));
    }
    for (size_t p = 0; p < shapes.size(); ++p) {
      ParameterSpec spec{.name = "p" + std::to_string(p), .shape = shapes[p]};
      spec.initial_values = values[p];
      if (shapes[p].size() == 1) spec.weight_decay = 0.0;
      if (p == 4) spec.lr_scale = 0.5;
      if (p == 5) spec.frozen = true;
      specs.push_back(std::move(spec));
    }
  }
};

/// Rank `rank`'s gradient of element `i` of parameter `p` in a micro-step: a small multiple of
/// 2^-8 (`scale` times that, for a norm that clips).
inline float Grad(int rank, int step, int micro, size_t p, size_t i, float scale = 1.0f) {
  const int k =
      int((size_t(rank) * 7 + size_t(step) * 3 + size_t(micro) * 5 + p * 11 + i * 13) % 17) - 8;
  return scale * float(k) / 256.0f;
}

using GradFn = std::function<float(int step, int micro, size_t p, size_t i)>;

/// The order a trainer's backward declares chunks' gradients in.
enum class DeclareOrder {
  kBackward,        // The last chunk first: the engine's reduce order.
  kLastTwoSwapped,  // The last two chunks with gradients the other way round (as autograd
                    // hooks may).
  kForward,         // The first chunk first: no chunk's reduce can start before the last.
};

/// One training step's forward and backward as a trainer drives them: forward over every chunk,
/// backward writing `grad`'s gradients in `order`, for each micro-step. `micro_steps`: the
/// options' gradient_accumulation_steps (ShardedOptions': 2).
inline Status ForwardBackward(Engine& engine, int step, const GradFn& grad,
                              DeclareOrder order = DeclareOrder::kBackward, int micro_steps = 2) {
  const ChunkLayout& layout = engine.layout();
  const int gas = micro_steps;
  std::vector<size_t> backward;
  for (size_t c = engine.chunk_count(); c-- > 0;) backward.push_back(c);
  if (order == DeclareOrder::kForward) std::reverse(backward.begin(), backward.end());
  if (order == DeclareOrder::kLastTwoSwapped) {
    // The first two chunks backward reaches that have gradients (the last is frozen).
    size_t first = 0;
    while (layout.chunk(backward[first]).frozen) ++first;
    std::swap(backward[first], backward[first + 1]);
  }
  for (int micro = 0; micro < gas; ++micro) {
    for (size_t c = 0; c < engine.chunk_count(); ++c) {
      STRATA_RETURN_IF_ERROR(engine.Acquire(c).status());
      engine.Release(c);
    }
    for (size_t c : backward) {
      STRATA_ASSIGN_OR_RETURN(ChunkView view, engine.Acquire(c));
      if (view.grads != nullptr) {
        auto* grads = static_cast<float*>(view.grads);
        for (size_t p = 0; p < layout.parameter_count(); ++p) {
          const ParameterLocation& loc = layout.location(p);
          if (loc.chunk != c) continue;
          for (size_t i = 0; i < loc.numel; ++i) grads[loc.offset + i] = grad(step, micro, p, i);
        }
        STRATA_RETURN_IF_ERROR(engine.GradsReady(c));
      }
      engine.Release(c);
    }
  }
  return Status();
}

/// ForwardBackward, then Step().
inline Result<StepReport> TrainStep(Engine& engine, int step, const GradFn& grad,
                                    DeclareOrder order = DeclareOrder::kBackward,
                                    int micro_steps = 2) {
  STRATA_RETURN_IF_ERROR(ForwardBackward(engine, step, grad, order, micro_steps));
  return engine.Step().get();
}

/// Every parameter's working values, as the device holds them.
inline std::vector<std::vector<float>> WorkingParameters(Engine& engine) {
  const ChunkLayout& layout = engine.layout();
  std::vector<std::vector<float>> out;
  for (size_t p = 0; p < layout.parameter_count(); ++p) {
    const ParameterLocation& loc = layout.location(p);
    auto view = engine.Acquire(loc.chunk);
    EXPECT_TRUE(view.ok()) << view.status().ToString();
    if (!view.ok()) return {};
    const auto* params = static_cast<const float*>(view->params);
    out.emplace_back(params + loc.offset, params + loc.offset + loc.numel);
    engine.Release(loc.chunk);
  }
  return out;
}

/// The environments of a sharded run whose rank `faulty` does its NVMe I/O through `plan`'s
/// faults (the others through the plain backend): one rank's drive failing.
inline std::function<EngineEnvironment(int)> FaultyRankEnvironment(
    int faulty, std::shared_ptr<nvme::FaultPlan> plan) {
  return [faulty, plan](int rank) {
    EngineEnvironment env;
    if (rank == faulty) {
      env.wrap_io_backend = [plan](std::unique_ptr<nvme::IoBackend> inner) {
        return nvme::CreateFaultInjectingBackend(std::move(inner), plan);
      };
    }
    return env;
  };
}

inline EngineOptions ShardedOptions(Tier states, const std::string& nvme_path) {
  EngineOptions o;
  o.precision.working_dtype = DType::kFp32;
  o.placement.optimizer_states = states;
  o.placement.params = Tier::kDevice;
  o.placement.chunk_bytes = kShardedChunkBytes;
  o.placement.zero_stage = 2;
  o.nvme.paths = {nvme_path};
  o.optimizer.lr = 1e-2;
  o.optimizer.weight_decay = 0.1;
  o.optimizer.cpu_threads = 1;
  o.optimizer.gradient_accumulation_steps = 2;
  o.host.optimizer_buffer_count = 3;
  return o;
}

/// ShardedOptions with ZeRO stage 3: each rank keeps its shard of the parameters in host memory.
inline EngineOptions Stage3Options(Tier states, const std::string& nvme_path) {
  EngineOptions o = ShardedOptions(states, nvme_path);
  o.placement.zero_stage = 3;
  o.placement.params = Tier::kHost;
  return o;
}

}  // namespace strata::offload::testing
