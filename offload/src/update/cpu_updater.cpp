#include "update/cpu_updater.h"

#include <cstring>

#include "strata/cpu_adam/cpu_optimizer.h"

namespace strata::offload {
namespace {

/// AdamW's and Adam's hyper-parameters, which have the same fields, from the options.
template <typename HyperParams>
HyperParams AdamFamily(const OptimizerOptions& o, double lr, double weight_decay, int64_t step,
                       double grad_scale) {
  return {.lr = lr,
          .beta1 = o.beta1,
          .beta2 = o.beta2,
          .eps = o.eps,
          .weight_decay = weight_decay,
          .bias_correction = o.bias_correction,
          .step = step,
          .grad_scale = grad_scale};
}

/// One optimizer step of `o.type` over `buffers`.
Status StepOnce(cpu_adam::CpuOptimizer& cpu, const OptimizerOptions& o, double lr,
                double weight_decay, int64_t step, double grad_scale,
                const cpu_adam::StepBuffers& buffers) {
  switch (o.type) {
    case OptimizerType::kAdamW:
      return cpu.Step(
          AdamFamily<cpu_adam::AdamWHyperParams>(o, lr, weight_decay, step, grad_scale), buffers);
    case OptimizerType::kAdam:
      return cpu.Step(
          AdamFamily<cpu_adam::AdamHyperParams>(o, lr, weight_decay, step, grad_scale), buffers);
    case OptimizerType::kAdagrad:
      return cpu.Step(cpu_adam::AdagradHyperParams{.lr = lr,
                                                   .weight_decay = weight_decay,
                                                   .eps = o.eps,
                                                   .step = step,
                                                   .grad_scale = grad_scale},
                      buffers);
    case OptimizerType::kLion:
      return cpu.Step(cpu_adam::LionHyperParams{.lr = lr,
                                                .beta1 = o.beta1,
                                                .beta2 = o.beta2,
                                                .weight_decay = weight_decay,
                                                .grad_scale = grad_scale},
                      buffers);
  }
  return Internal("unknown optimizer type");
}

}  // namespace

bool CpuUpdater::Serves(const Device& device, Tier tier) {
  return tier != Tier::kDevice || device.properties().kind == DeviceKind::kHost;
}

Result<std::unique_ptr<Updater>> CpuUpdater::Make(const UpdaterContext& context) {
  return std::unique_ptr<Updater>(std::make_unique<CpuUpdater>(context.cpu));
}

Status CpuUpdater::Update(const ChunkUpdate& u) {
  const OptimizerOptions& o = *u.optimizer;
  const size_t numel = u.numel;
  const DType wdtype = u.working_dtype;
  const bool copy_out = wdtype != DType::kFp32 && u.param_copy != nullptr;
  const bool out_of_place = u.states_out != u.states;
  // One call per run of parameters that share their group settings (one run in most models).
  for (const ChunkSegment& segment : u.segments) {
    const size_t begin = segment.begin;
    const cpu_adam::StepBuffers buffers{
        .numel = segment.end - begin,
        .params = u.states + begin,
        .grads = static_cast<const std::byte*>(u.grads) + begin * DTypeSize(u.grad_dtype),
        .grad_dtype = u.grad_dtype,
        .exp_avg = u.states + numel + begin,
        .exp_avg_sq = u.states + 2 * numel + begin,
        .param_copy =
            copy_out ? static_cast<std::byte*>(u.param_copy) + begin * DTypeSize(wdtype) : nullptr,
        .param_copy_dtype = copy_out ? wdtype : DType::kBf16,
        .params_out = out_of_place ? u.states_out + begin : nullptr,
        .exp_avg_out = out_of_place && UsesExpAvg(o.type) ? u.states_out + numel + begin : nullptr,
        .exp_avg_sq_out =
            out_of_place && UsesExpAvgSq(o.type) ? u.states_out + 2 * numel + begin : nullptr};
    STRATA_RETURN_IF_ERROR(StepOnce(cpu_, o, u.lr * segment.lr_scale,
                                    segment.weight_decay.value_or(o.weight_decay), u.step,
                                    u.grad_scale, buffers));
  }
  if (wdtype == DType::kFp32 && u.param_copy != nullptr) {
    // On the kernels' threads, as they wrote the master: one thread's memcpy is a fraction of
    // the memory bandwidth.
    const float* master = u.states_out;
    cpu_.ParallelFor(numel, [&](size_t begin, size_t end) {
      std::memcpy(static_cast<float*>(u.param_copy) + begin, master + begin,
                  (end - begin) * sizeof(float));
    });
  }
  return Status();
}

}  // namespace strata::offload
