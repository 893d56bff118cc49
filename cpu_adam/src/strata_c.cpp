// The C interface: thin wrappers that convert structs, catch every error as a code plus a
// thread-local message, and never let a C++ exception cross into C.
#include "strata/cpu_adam/strata_c.h"

#include <exception>
#include <string>
#include <utility>

#include "strata/cpu_adam/cpu_optimizer.h"

using strata::DType;
using strata::Status;
using strata::StatusCode;
using strata::cpu_adam::CpuOptimizer;

static_assert(STRATA_C_INVALID_ARGUMENT == static_cast<int>(StatusCode::kInvalidArgument));
static_assert(STRATA_C_UNAVAILABLE == static_cast<int>(StatusCode::kUnavailable));
static_assert(STRATA_C_INTERNAL == static_cast<int>(StatusCode::kInternal));
static_assert(STRATA_C_FP32 == static_cast<int>(DType::kFp32));
static_assert(STRATA_C_FP16 == static_cast<int>(DType::kFp16));
static_assert(STRATA_C_BF16 == static_cast<int>(DType::kBf16));

struct strata_cpu_optimizer {
  CpuOptimizer optimizer;
};

namespace {

thread_local std::string last_error;

int Report(const Status& status) {
  last_error = status.ok() ? "" : status.ToString();
  return static_cast<int>(status.code());
}

// Runs `fn` (returning a Status), turning exceptions (e.g. std::bad_alloc) into kInternal.
template <typename Fn>
int Guard(Fn&& fn) {
  try {
    return Report(std::forward<Fn>(fn)());
  } catch (const std::exception& e) {
    return Report(strata::Internal(std::string("unexpected exception: ") + e.what()));
  }
}

strata::Result<DType> ToDType(int32_t value, const char* field) {
  if (value == STRATA_C_FP32 || value == STRATA_C_FP16 || value == STRATA_C_BF16) {
    return static_cast<DType>(value);
  }
  return strata::InvalidArgument(std::string(field) +
                                 " must be STRATA_C_FP32 (0), _FP16 (1) or "
                                 "_BF16 (2), got " +
                                 std::to_string(value));
}

strata::Result<strata::cpu_adam::StepBuffers> ToStepBuffers(const strata_step_buffers* b) {
  if (b == nullptr) return strata::InvalidArgument("buffers is NULL");
  STRATA_ASSIGN_OR_RETURN(const DType grad_dtype, ToDType(b->grad_dtype, "grad_dtype"));
  STRATA_ASSIGN_OR_RETURN(const DType state_dtype, ToDType(b->state_dtype, "state_dtype"));
  DType copy_dtype = DType::kBf16;
  if (b->param_copy != nullptr) {
    STRATA_ASSIGN_OR_RETURN(copy_dtype, ToDType(b->param_copy_dtype, "param_copy_dtype"));
  }
  return strata::cpu_adam::StepBuffers{
      .numel = static_cast<size_t>(b->numel),
      .params = b->params,
      .grads = b->grads,
      .grad_dtype = grad_dtype,
      .exp_avg = b->exp_avg,
      .exp_avg_sq = b->exp_avg_sq,
      .state_dtype = state_dtype,
      .param_copy = b->param_copy,
      .param_copy_dtype = copy_dtype,
  };
}

template <typename HyperParams>
int RunStep(strata_cpu_optimizer* optimizer, const void* hyper_params,
            const strata_step_buffers* buffers, HyperParams (*convert)(const void*)) {
  return Guard([&]() -> Status {
    if (optimizer == nullptr) return strata::InvalidArgument("optimizer is NULL");
    if (hyper_params == nullptr) return strata::InvalidArgument("hyper_params is NULL");
    STRATA_ASSIGN_OR_RETURN(const auto step_buffers, ToStepBuffers(buffers));
    return optimizer->optimizer.Step(convert(hyper_params), step_buffers);
  });
}

template <typename AdamHyperParams>
AdamHyperParams ToAdam(const void* raw) {
  const auto* h = static_cast<const strata_adam_hyper_params*>(raw);
  return AdamHyperParams{.lr = h->lr,
                         .beta1 = h->beta1,
                         .beta2 = h->beta2,
                         .eps = h->eps,
                         .weight_decay = h->weight_decay,
                         .bias_correction = h->bias_correction != 0,
                         .step = h->step,
                         .grad_scale = h->grad_scale};
}

strata::cpu_adam::AdagradHyperParams ToAdagrad(const void* raw) {
  const auto* h = static_cast<const strata_adagrad_hyper_params*>(raw);
  return {.lr = h->lr,
          .lr_decay = h->lr_decay,
          .weight_decay = h->weight_decay,
          .eps = h->eps,
          .step = h->step,
          .grad_scale = h->grad_scale};
}

strata::cpu_adam::LionHyperParams ToLion(const void* raw) {
  const auto* h = static_cast<const strata_lion_hyper_params*>(raw);
  return {.lr = h->lr,
          .beta1 = h->beta1,
          .beta2 = h->beta2,
          .weight_decay = h->weight_decay,
          .grad_scale = h->grad_scale};
}

template <typename HyperParams>
void FillAdamDefaults(strata_adam_hyper_params* out) {
  const HyperParams d;
  *out = {.lr = d.lr,
          .beta1 = d.beta1,
          .beta2 = d.beta2,
          .eps = d.eps,
          .weight_decay = d.weight_decay,
          .bias_correction = d.bias_correction ? 1 : 0,
          .step = d.step,
          .grad_scale = d.grad_scale};
}

}  // namespace

extern "C" {

int strata_cpu_optimizer_create(int32_t threads, const char* simd, strata_cpu_optimizer** out) {
  return Guard([&]() -> Status {
    if (out == nullptr) return strata::InvalidArgument("out is NULL");
    *out = nullptr;
    strata::cpu_adam::CpuOptimizerOptions options{.threads = threads};
    if (simd != nullptr && std::string_view(simd) != "" && std::string_view(simd) != "auto") {
      STRATA_ASSIGN_OR_RETURN(options.simd, strata::cpu_adam::ParseSimdLevel(simd));
    }
    STRATA_ASSIGN_OR_RETURN(CpuOptimizer optimizer, CpuOptimizer::Create(options));
    *out = new strata_cpu_optimizer{std::move(optimizer)};
    return Status::Ok();
  });
}

void strata_cpu_optimizer_destroy(strata_cpu_optimizer* optimizer) { delete optimizer; }

const char* strata_cpu_optimizer_simd_level(const strata_cpu_optimizer* optimizer) {
  if (optimizer == nullptr) return "";
  // SimdLevelName returns views of string literals, so data() is NUL-terminated and static.
  return strata::cpu_adam::SimdLevelName(optimizer->optimizer.simd_level()).data();
}

int32_t strata_cpu_optimizer_threads(const strata_cpu_optimizer* optimizer) {
  return optimizer == nullptr ? 0 : optimizer->optimizer.threads();
}

void strata_adamw_defaults(strata_adam_hyper_params* hyper_params) {
  if (hyper_params != nullptr) FillAdamDefaults<strata::cpu_adam::AdamWHyperParams>(hyper_params);
}

void strata_adam_defaults(strata_adam_hyper_params* hyper_params) {
  if (hyper_params != nullptr) FillAdamDefaults<strata::cpu_adam::AdamHyperParams>(hyper_params);
}

void strata_adagrad_defaults(strata_adagrad_hyper_params* hyper_params) {
  if (hyper_params == nullptr) return;
  const strata::cpu_adam::AdagradHyperParams d;
  *hyper_params = {.lr = d.lr,
                   .lr_decay = d.lr_decay,
                   .weight_decay = d.weight_decay,
                   .eps = d.eps,
                   .step = d.step,
                   .grad_scale = d.grad_scale};
}

void strata_lion_defaults(strata_lion_hyper_params* hyper_params) {
  if (hyper_params == nullptr) return;
  const strata::cpu_adam::LionHyperParams d;
  *hyper_params = {.lr = d.lr,
                   .beta1 = d.beta1,
                   .beta2 = d.beta2,
                   .weight_decay = d.weight_decay,
                   .grad_scale = d.grad_scale};
}

int strata_adamw_step(strata_cpu_optimizer* optimizer, const strata_adam_hyper_params* hyper_params,
                      const strata_step_buffers* buffers) {
  return RunStep(optimizer, hyper_params, buffers, &ToAdam<strata::cpu_adam::AdamWHyperParams>);
}

int strata_adam_step(strata_cpu_optimizer* optimizer, const strata_adam_hyper_params* hyper_params,
                     const strata_step_buffers* buffers) {
  return RunStep(optimizer, hyper_params, buffers, &ToAdam<strata::cpu_adam::AdamHyperParams>);
}

int strata_adagrad_step(strata_cpu_optimizer* optimizer,
                        const strata_adagrad_hyper_params* hyper_params,
                        const strata_step_buffers* buffers) {
  return RunStep(optimizer, hyper_params, buffers, &ToAdagrad);
}

int strata_lion_step(strata_cpu_optimizer* optimizer, const strata_lion_hyper_params* hyper_params,
                     const strata_step_buffers* buffers) {
  return RunStep(optimizer, hyper_params, buffers, &ToLion);
}

int strata_gradient_stats(strata_cpu_optimizer* optimizer, const void* grads, int32_t dtype,
                          uint64_t numel, double* sum_of_squares, int32_t* all_finite) {
  return Guard([&]() -> Status {
    if (optimizer == nullptr) return strata::InvalidArgument("optimizer is NULL");
    if (sum_of_squares == nullptr || all_finite == nullptr) {
      return strata::InvalidArgument("sum_of_squares and all_finite must not be NULL");
    }
    STRATA_ASSIGN_OR_RETURN(const DType grad_dtype, ToDType(dtype, "dtype"));
    STRATA_ASSIGN_OR_RETURN(const auto stats, optimizer->optimizer.ComputeGradientStats(
                                                  grads, grad_dtype, static_cast<size_t>(numel)));
    *sum_of_squares = stats.sum_of_squares;
    *all_finite = stats.all_finite ? 1 : 0;
    return Status::Ok();
  });
}

int strata_fill(strata_cpu_optimizer* optimizer, void* data, int32_t dtype, uint64_t numel,
                float value) {
  return Guard([&]() -> Status {
    if (optimizer == nullptr) return strata::InvalidArgument("optimizer is NULL");
    STRATA_ASSIGN_OR_RETURN(const DType fill_dtype, ToDType(dtype, "dtype"));
    return optimizer->optimizer.Fill(data, fill_dtype, static_cast<size_t>(numel), value);
  });
}

const char* strata_last_error(void) { return last_error.c_str(); }

}  // extern "C"
