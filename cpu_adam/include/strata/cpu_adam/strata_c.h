/* strata_c.h: a C interface to Strata's CPU optimizer kernels, for other languages (Python
 * ctypes, Rust, Julia, ...). Built as the shared library libstrata_cpu_adam_c.so.
 *
 * Every function that can fail returns 0 on success or a nonzero strata::StatusCode value
 * (STRATA_C_INVALID_ARGUMENT, STRATA_C_UNAVAILABLE, ...); strata_last_error() then returns the
 * message, for the calling thread. Structs are passed by pointer; fill them with the *_defaults
 * functions first, which set PyTorch's defaults, then change what you need. Hyper-parameters and
 * semantics are those of strata/cpu_adam/cpu_optimizer.h.
 *
 * Thread safety: an optimizer may be used from several threads at once. */
#ifndef STRATA_CPU_ADAM_STRATA_C_H_
#define STRATA_CPU_ADAM_STRATA_C_H_

#include <stddef.h> /* NOLINT(modernize-deprecated-headers): a C header. */
#include <stdint.h> /* NOLINT(modernize-deprecated-headers) */

#if defined(__GNUC__)
#define STRATA_C_API __attribute__((visibility("default")))
#else
#define STRATA_C_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* This is a C header: typedefs, not using-declarations. */
/* NOLINTBEGIN(modernize-use-using) */

/* Status codes (the values of strata::StatusCode). */
#define STRATA_C_OK 0
#define STRATA_C_INVALID_ARGUMENT 1
#define STRATA_C_UNAVAILABLE 8
#define STRATA_C_INTERNAL 10

/* Element types (the values of strata::DType). */
#define STRATA_C_FP32 0
#define STRATA_C_FP16 1
#define STRATA_C_BF16 2

/* An optimizer: a thread arena and a chosen SIMD level. Opaque. */
typedef struct strata_cpu_optimizer strata_cpu_optimizer;

/* The arrays of one step; see strata::cpu_adam::StepBuffers. Unused arrays may be NULL. */
typedef struct strata_step_buffers {
  uint64_t numel;           /* Elements in each array. */
  float* params;            /* fp32 master parameters, updated in place. */
  const void* grads;        /* Gradients, read only. */
  int32_t grad_dtype;       /* STRATA_C_FP32, _FP16 or _BF16. */
  void* exp_avg;            /* AdamW/Adam/Lion first moment. */
  void* exp_avg_sq;         /* AdamW/Adam second moment, Adagrad sum. */
  int32_t state_dtype;      /* STRATA_C_FP32 or _BF16. */
  void* param_copy;         /* Optional fp16/bf16 copy of the updated params; NULL for none. */
  int32_t param_copy_dtype; /* STRATA_C_FP16 or _BF16. */
} strata_step_buffers;

/* AdamW and Adam. */
typedef struct strata_adam_hyper_params {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;     /* AdamW: decoupled; Adam: L2 added to the gradient. */
  int32_t bias_correction; /* Nonzero: torch's bias correction. */
  int64_t step;            /* Counts from 1. */
  double grad_scale;       /* Multiplies every gradient element. */
} strata_adam_hyper_params;

typedef struct strata_adagrad_hyper_params {
  double lr;
  double lr_decay;
  double weight_decay;
  double eps;
  int64_t step;
  double grad_scale;
} strata_adagrad_hyper_params;

typedef struct strata_lion_hyper_params {
  double lr;
  double beta1;
  double beta2;
  double weight_decay;
  double grad_scale;
} strata_lion_hyper_params;
/* NOLINTEND(modernize-use-using) */

/* Creates an optimizer with `threads` threads (0 = all) running the kernels named by `simd`
 * ("scalar", "avx2", "avx512"; NULL, "" or "auto" to let Strata choose). */
STRATA_C_API int strata_cpu_optimizer_create(int32_t threads, const char* simd,
                                             strata_cpu_optimizer** out);
/* Destroys an optimizer; NULL is ignored. */
STRATA_C_API void strata_cpu_optimizer_destroy(strata_cpu_optimizer* optimizer);
/* "scalar", "avx2" or "avx512". The string is static. */
STRATA_C_API const char* strata_cpu_optimizer_simd_level(const strata_cpu_optimizer* optimizer);
STRATA_C_API int32_t strata_cpu_optimizer_threads(const strata_cpu_optimizer* optimizer);

/* Fill with PyTorch's defaults (AdamW: weight_decay 0.01; Adam: 0). */
STRATA_C_API void strata_adamw_defaults(strata_adam_hyper_params* hyper_params);
STRATA_C_API void strata_adam_defaults(strata_adam_hyper_params* hyper_params);
STRATA_C_API void strata_adagrad_defaults(strata_adagrad_hyper_params* hyper_params);
STRATA_C_API void strata_lion_defaults(strata_lion_hyper_params* hyper_params);

/* One optimizer step. */
STRATA_C_API int strata_adamw_step(strata_cpu_optimizer* optimizer,
                                   const strata_adam_hyper_params* hyper_params,
                                   const strata_step_buffers* buffers);
STRATA_C_API int strata_adam_step(strata_cpu_optimizer* optimizer,
                                  const strata_adam_hyper_params* hyper_params,
                                  const strata_step_buffers* buffers);
STRATA_C_API int strata_adagrad_step(strata_cpu_optimizer* optimizer,
                                     const strata_adagrad_hyper_params* hyper_params,
                                     const strata_step_buffers* buffers);
STRATA_C_API int strata_lion_step(strata_cpu_optimizer* optimizer,
                                  const strata_lion_hyper_params* hyper_params,
                                  const strata_step_buffers* buffers);

/* Sum of squares of `numel` gradients of `dtype` and whether all are finite (1) or not (0). */
STRATA_C_API int strata_gradient_stats(strata_cpu_optimizer* optimizer, const void* grads,
                                       int32_t dtype, uint64_t numel, double* sum_of_squares,
                                       int32_t* all_finite);

/* Sets `numel` elements of `data` to `value` (e.g. Adagrad's initial_accumulator_value). */
STRATA_C_API int strata_fill(strata_cpu_optimizer* optimizer, void* data, int32_t dtype,
                             uint64_t numel, float value);

/* The message of the last failed call on this thread; "" if none. Valid until the next call. */
STRATA_C_API const char* strata_last_error(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_CPU_ADAM_STRATA_C_H_ */
