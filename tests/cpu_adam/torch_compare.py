#!/usr/bin/python3
"""Compares Strata's CPU optimizers with PyTorch's, through the C interface and ctypes.

Usage: torch_compare.py path/to/libstrata_cpu_adam_c.so

For AdamW, Adam and Adagrad, runs 50 steps with random hyper-parameters, a learning rate that
changes every step and fresh random gradients, on the same parameters in torch.optim and in
Strata (at every SIMD level this CPU runs, fp32 and bf16 gradients), and compares parameters
and states after every step. Lion, which torch lacks, is compared with a float32 NumPy
transcription of the paper's update.

Tolerance: |strata - torch| <= RTOL * |torch| + ATOL * max|torch| for each tensor, with
RTOL = 1e-5 and ATOL = 1e-6. Both sides compute in fp32 and differ only by rounding order (fused
multiply-adds, a reciprocal instead of a division), a few units in the last place per step
(2^-23 = 1.2e-7 relative) that 50 steps accumulate; ATOL covers elements near zero, where a
cancellation makes relative differences meaningless.

Exits 0 when everything matches, 1 on a mismatch, 77 (skipped) when torch cannot be imported.
"""
import ctypes
import math
import random
import sys

try:
    import numpy as np
    import torch
except ImportError as error:  # Debian's python3-torch / python3-numpy are not installed.
    print(f"SKIP: cannot import torch and numpy ({error})")
    sys.exit(77)

RTOL = 1e-5
ATOL = 1e-6
STEPS = 50
NUMEL = 10_007  # Odd: exercises the vector tails.
FP32, FP16, BF16 = 0, 1, 2


class StepBuffers(ctypes.Structure):
    _fields_ = [("numel", ctypes.c_uint64), ("params", ctypes.c_void_p),
                ("grads", ctypes.c_void_p), ("grad_dtype", ctypes.c_int32),
                ("exp_avg", ctypes.c_void_p), ("exp_avg_sq", ctypes.c_void_p),
                ("state_dtype", ctypes.c_int32), ("param_copy", ctypes.c_void_p),
                ("param_copy_dtype", ctypes.c_int32)]


class AdamHyperParams(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("bias_correction", ctypes.c_int32), ("step", ctypes.c_int64),
                ("grad_scale", ctypes.c_double)]


class AdagradHyperParams(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("lr_decay", ctypes.c_double),
                ("weight_decay", ctypes.c_double), ("eps", ctypes.c_double),
                ("step", ctypes.c_int64), ("grad_scale", ctypes.c_double)]


class LionHyperParams(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("weight_decay", ctypes.c_double), ("grad_scale", ctypes.c_double)]


def load_library(path):
    lib = ctypes.CDLL(path)
    lib.strata_cpu_optimizer_create.argtypes = [ctypes.c_int32, ctypes.c_char_p,
                                                ctypes.POINTER(ctypes.c_void_p)]
    lib.strata_cpu_optimizer_destroy.argtypes = [ctypes.c_void_p]
    lib.strata_cpu_optimizer_simd_level.argtypes = [ctypes.c_void_p]
    lib.strata_cpu_optimizer_simd_level.restype = ctypes.c_char_p
    lib.strata_last_error.restype = ctypes.c_char_p
    for name, params in [("adamw", AdamHyperParams), ("adam", AdamHyperParams),
                         ("adagrad", AdagradHyperParams), ("lion", LionHyperParams)]:
        getattr(lib, f"strata_{name}_step").argtypes = [
            ctypes.c_void_p, ctypes.POINTER(params), ctypes.POINTER(StepBuffers)]
        getattr(lib, f"strata_{name}_defaults").argtypes = [ctypes.POINTER(params)]
    lib.strata_fill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                                ctypes.c_uint64, ctypes.c_float]
    return lib


def check(lib, code):
    if code != 0:
        raise RuntimeError(lib.strata_last_error().decode())


def create_optimizer(lib, simd):
    handle = ctypes.c_void_p()
    check(lib, lib.strata_cpu_optimizer_create(2, simd.encode(), ctypes.byref(handle)))
    return handle


def supported_levels(lib):
    levels = []
    for simd in ("scalar", "avx2", "avx512"):
        handle = ctypes.c_void_p()
        if lib.strata_cpu_optimizer_create(1, simd.encode(), ctypes.byref(handle)) == 0:
            levels.append(simd)
            lib.strata_cpu_optimizer_destroy(handle)
    return levels


def pointer(array):
    return array.ctypes.data_as(ctypes.c_void_p)


def to_bf16_bits(values):
    """float32 -> bf16 bits, round to nearest even (as torch's .to(torch.bfloat16))."""
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def bf16_bits_to_float(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def worst_difference(actual, expected):
    """The largest |a - e| / (RTOL |e| + ATOL max|e|): <= 1 passes."""
    expected = expected.astype(np.float64)
    allowed = RTOL * np.abs(expected) + ATOL * max(np.abs(expected).max(), 1e-30)
    return float((np.abs(actual.astype(np.float64) - expected) / allowed).max())


def compare(name, arrays, tensors, step):
    worst = 0.0
    for label, actual, expected in zip(("params", "state1", "state2"), arrays, tensors):
        ratio = worst_difference(actual, expected.detach().numpy())
        if not ratio <= 1.0:  # Also catches NaN.
            print(f"FAIL {name}: {label} differs from torch at step {step} "
                  f"({ratio:.2f} x the tolerance)")
            return math.inf
        worst = max(worst, ratio)
    return worst


def random_adam_settings(rng):
    return dict(beta1=rng.uniform(0.8, 0.95), beta2=rng.uniform(0.95, 0.9999),
                eps=rng.choice([1e-8, 1e-6, 1e-10]), weight_decay=rng.uniform(0.0, 0.1))


def run_adam(lib, simd, grad_dtype, decoupled, seed):
    """AdamW (decoupled) or Adam vs torch.optim over STEPS steps."""
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    settings = random_adam_settings(rng)
    params = np_rng.uniform(-1, 1, NUMEL).astype(np.float32)
    exp_avg = np.zeros(NUMEL, np.float32)
    exp_avg_sq = np.zeros(NUMEL, np.float32)
    torch_param = torch.nn.Parameter(torch.from_numpy(params.copy()))
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    torch_optimizer = torch_class([torch_param], lr=1e-3,
                                  betas=(settings["beta1"], settings["beta2"]),
                                  eps=settings["eps"], weight_decay=settings["weight_decay"])
    optimizer = create_optimizer(lib, simd)
    step_function = lib.strata_adamw_step if decoupled else lib.strata_adam_step
    worst = 0.0
    try:
        for step in range(1, STEPS + 1):
            lr = 10 ** rng.uniform(-4, -2)  # A schedule that changes every step.
            grad_scale = rng.choice([1.0, 0.5, 1 / 1024])
            raw = (np_rng.standard_normal(NUMEL) * 1e-2 / grad_scale).astype(np.float32)
            if grad_dtype == BF16:
                grad_bits = to_bf16_bits(raw)
                grads, raw = grad_bits, bf16_bits_to_float(grad_bits)
            else:
                grads = raw
            # torch sees the gradient Strata computes first: raw * grad_scale, in fp32.
            torch_param.grad = torch.from_numpy(raw) * np.float32(grad_scale)
            for group in torch_optimizer.param_groups:
                group["lr"] = lr
            torch_optimizer.step()

            hyper = AdamHyperParams(lr=lr, beta1=settings["beta1"], beta2=settings["beta2"],
                                    eps=settings["eps"], weight_decay=settings["weight_decay"],
                                    bias_correction=1, step=step, grad_scale=grad_scale)
            buffers = StepBuffers(numel=NUMEL, params=pointer(params), grads=pointer(grads),
                                  grad_dtype=grad_dtype, exp_avg=pointer(exp_avg),
                                  exp_avg_sq=pointer(exp_avg_sq), state_dtype=FP32)
            check(lib, step_function(optimizer, ctypes.byref(hyper), ctypes.byref(buffers)))
            state = torch_optimizer.state[torch_param]
            worst = max(worst, compare(
                f"{'AdamW' if decoupled else 'Adam'} {simd}", (params, exp_avg, exp_avg_sq),
                (torch_param, state["exp_avg"], state["exp_avg_sq"]), step))
            if math.isinf(worst):
                break
    finally:
        lib.strata_cpu_optimizer_destroy(optimizer)
    return worst


def run_adagrad(lib, simd, grad_dtype, seed):
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    lr_decay = rng.uniform(0.0, 0.01)
    weight_decay = rng.uniform(0.0, 0.1)
    initial_accumulator_value = rng.uniform(0.0, 0.1)
    params = np_rng.uniform(-1, 1, NUMEL).astype(np.float32)
    state_sum = np.empty(NUMEL, np.float32)
    torch_param = torch.nn.Parameter(torch.from_numpy(params.copy()))
    torch_optimizer = torch.optim.Adagrad(
        [torch_param], lr=1e-2, lr_decay=lr_decay, weight_decay=weight_decay,
        initial_accumulator_value=initial_accumulator_value)  # eps: torch's default, 1e-10.
    optimizer = create_optimizer(lib, simd)
    check(lib, lib.strata_fill(optimizer, pointer(state_sum), FP32, NUMEL,
                               initial_accumulator_value))
    worst = 0.0
    try:
        for step in range(1, STEPS + 1):
            lr = 10 ** rng.uniform(-3, -1)
            raw = (np_rng.standard_normal(NUMEL) * 1e-2).astype(np.float32)
            if grad_dtype == BF16:
                grads = to_bf16_bits(raw)
                raw = bf16_bits_to_float(grads)
            else:
                grads = raw
            torch_param.grad = torch.from_numpy(raw.copy())
            for group in torch_optimizer.param_groups:
                group["lr"] = lr
            torch_optimizer.step()

            hyper = AdagradHyperParams()
            lib.strata_adagrad_defaults(ctypes.byref(hyper))
            hyper.lr, hyper.lr_decay, hyper.weight_decay, hyper.step = (
                lr, lr_decay, weight_decay, step)
            buffers = StepBuffers(numel=NUMEL, params=pointer(params), grads=pointer(grads),
                                  grad_dtype=grad_dtype, exp_avg_sq=pointer(state_sum),
                                  state_dtype=FP32)
            check(lib, lib.strata_adagrad_step(optimizer, ctypes.byref(hyper),
                                               ctypes.byref(buffers)))
            state = torch_optimizer.state[torch_param]
            worst = max(worst, compare(f"Adagrad {simd}", (params, state_sum),
                                       (torch_param, state["sum"]), step))
            if math.isinf(worst):
                break
    finally:
        lib.strata_cpu_optimizer_destroy(optimizer)
    return worst


def run_lion(lib, simd, seed):
    """Lion vs a float32 NumPy transcription of the paper's Algorithm 2."""
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    beta1, beta2 = rng.uniform(0.85, 0.95), rng.uniform(0.95, 0.999)
    weight_decay = rng.uniform(0.0, 1.0)
    params = np_rng.uniform(-1, 1, NUMEL).astype(np.float32)
    exp_avg = np.zeros(NUMEL, np.float32)
    ref_params, ref_exp_avg = params.copy(), exp_avg.copy()
    optimizer = create_optimizer(lib, simd)
    worst = 0.0
    f32 = np.float32
    try:
        for step in range(1, STEPS + 1):
            lr = 10 ** rng.uniform(-5, -3)
            grads = (np_rng.standard_normal(NUMEL) * 1e-2).astype(np.float32)
            update = np.sign(f32(beta1) * ref_exp_avg + f32(1 - beta1) * grads)
            ref_params = ref_params * f32(1 - lr * weight_decay) - f32(lr) * update
            ref_exp_avg = f32(beta2) * ref_exp_avg + f32(1 - beta2) * grads

            hyper = LionHyperParams(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                                    grad_scale=1.0)
            buffers = StepBuffers(numel=NUMEL, params=pointer(params), grads=pointer(grads),
                                  grad_dtype=FP32, exp_avg=pointer(exp_avg), state_dtype=FP32)
            check(lib, lib.strata_lion_step(optimizer, ctypes.byref(hyper),
                                            ctypes.byref(buffers)))
            worst = max(worst, compare(f"Lion {simd}", (params, exp_avg),
                                       (torch.from_numpy(ref_params),
                                        torch.from_numpy(ref_exp_avg)), step))
            if math.isinf(worst):
                break
    finally:
        lib.strata_cpu_optimizer_destroy(optimizer)
    return worst


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    lib = load_library(sys.argv[1])
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, numpy {np.__version__}; tolerance: "
          f"rtol {RTOL}, atol {ATOL} x max|torch|; {STEPS} steps of {NUMEL} parameters")
    failed = False
    seed = 0
    for simd in supported_levels(lib):
        for grad_dtype, grad_name in ((FP32, "fp32"), (BF16, "bf16")):
            seed += 1
            results = {
                "AdamW": run_adam(lib, simd, grad_dtype, decoupled=True, seed=seed),
                "Adam": run_adam(lib, simd, grad_dtype, decoupled=False, seed=seed + 100),
                "Adagrad": run_adagrad(lib, simd, grad_dtype, seed=seed + 200),
            }
            if grad_dtype == FP32:
                results["Lion (vs NumPy)"] = run_lion(lib, simd, seed=seed + 300)
            for name, worst in results.items():
                ok = worst <= 1.0
                failed |= not ok
                print(f"{'ok  ' if ok else 'FAIL'} {name:16s} {simd:7s} grads {grad_name}: "
                      f"largest difference {worst:.3f} x the tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
