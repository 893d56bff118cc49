"""The engine's Strata-format config for an optimizer's arguments (docs/config.md)."""

from __future__ import annotations

import os
from typing import Any

import torch

WORKING_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# An `offload=` argument -> the engine's tier (placement.optimizer_states, placement.params).
_TIERS = {"cpu": "host", "host": "host", "nvme": "nvme", "none": "device", None: "device"}

# chunk_size="auto": a model's working parameters in this many chunks, each at most
# _MAX_AUTO_CHUNK. A chunk is the unit of overlap (backward hands the engine one at a time) and
# of NVMe staging (a few chunks' states in host memory at once); a small model in one 64 MiB
# chunk gets neither, and its NVMe staging would hold several copies of all its states.
_AUTO_CHUNKS = 16
_MAX_AUTO_CHUNK = 64 << 20
# offload="nvme": staging buffers for the states read ahead, as DeepSpeed's
# offload_optimizer.buffer_count defaults to. The engine's own default reads a whole step ahead
# within the host budget, which is fast but keeps every state in host memory as well: not what
# someone who chose NVMe to save memory wants. A config's host.optimizer_buffer_count wins.
_NVME_STATE_BUFFERS = 4

# Keys the optimizer sets from its own arguments or needs as they are: a `config` fragment may
# not override them (each would break the hooks' contract with the engine).
_OWN_KEYS = {
    ("device", "kind"): "the parameters' device",
    ("device", "cuda_device"): "the parameters' device",
    ("optimizer", "type"): "the optimizer class",
    ("optimizer", "gradient_accumulation_steps"): "the gradient_accumulation_steps argument",
    ("optimizer", "recheck_gradients"): "the parameters' device",
    ("optimizer", "delayed_update"): "nothing yet (forward does not wait for delayed updates)",
    ("optimizer", "delayed_update_from_step"): "nothing yet",
    ("precision", "working_dtype"): "the parameters' dtype",
    ("placement", "params"): "strata.torch.offload_parameters(model)",
    ("placement", "zero_stage"): "nothing yet (one rank)",
}


def engine_options(owner: str, group: dict[str, Any], lr: float, engine_type: str,
                   weight_decay: float, *,
                   device: torch.device, dtype: torch.dtype, offload: str | None,
                   nvme_path: Any, offload_ratio: float, chunk_size: Any, host_memory: Any,
                   cpu_threads: int, loss_scale: Any, speculative_updates: bool | None,
                   max_grad_norm: float, config: dict[str, Any] | None) -> dict[str, Any]:
    """`group` is the first param group (betas, eps); `lr` the engine's base learning rate."""
    states = tier_of(offload)
    optimizer: dict[str, Any] = {
        "type": engine_type,
        "lr": lr,
        "weight_decay": weight_decay,
        "gradient_clipping": max_grad_norm,
        "gradient_accumulation_steps": 1,  # torch accumulates in .grad; the hooks count.
        "cpu_threads": cpu_threads or default_cpu_threads(device),
        "speculative_updates": (speculates_by_default(device) if speculative_updates is None
                                else bool(speculative_updates)),
        # Whatever the trainer does to .grad between backward and step() (clip_grad_norm_,
        # GradScaler, edits through .data), step() uses the gradients as they are then: the
        # engine reads them again at step() and redoes the chunks that changed. CPU tensors
        # only (the engine reads a GPU's gradients on the CPU only through a copy).
        "recheck_gradients": rechecks_gradients(device),
    }
    if "betas" in group:
        optimizer["beta1"], optimizer["beta2"] = (float(b) for b in group["betas"])
    if "eps" in group:
        optimizer["eps"] = float(group["eps"])
    precision: dict[str, Any] = {"working_dtype": WORKING_DTYPES[dtype]}
    if dtype == torch.float16:
        precision["loss_scale"] = 0.0 if loss_scale == "dynamic" else float(loss_scale)
    options: dict[str, Any] = {
        "device": ({"kind": "cuda", "cuda_device": device.index or 0}
                   if device.type == "cuda" else {"kind": "host"}),
        "optimizer": optimizer,
        "precision": precision,
        "placement": {
            "zero_stage": 0,
            "optimizer_states": states,
            "offload_ratio": float(offload_ratio),
            "params": "device",
            "chunk_bytes": chunk_size,
        },
    }
    if states == "nvme":
        options["host"] = {"optimizer_buffer_count": _NVME_STATE_BUFFERS}
        options["nvme"] = {"paths": [nvme_directory(nvme_path)]}
    if host_memory is not None:
        options.setdefault("host", {})["pinned_memory_bytes"] = host_memory
    if device.type == "cuda":
        options.setdefault("host", {})["pin_memory"] = True
    _refuse_own_keys(owner, config or {})
    _merge(options, config or {})
    return options


def tier_of(offload: str | None, *, device_allowed: bool = True) -> str:
    """The engine's tier for an `offload=` argument ("cpu", "nvme"; None or "none" keeps it
    on the device where `device_allowed`)."""
    if offload not in _TIERS or (not device_allowed and _TIERS[offload] == "device"):
        allowed = "'cpu', 'nvme' or None" if device_allowed else "'cpu' or 'nvme'"
        raise ValueError(f"offload must be {allowed}, got {offload!r}")
    return _TIERS[offload]


def nvme_directory(nvme_path: Any) -> str:
    """`nvme_path` checked for offload="nvme": an existing directory."""
    if nvme_path is None:
        raise ValueError("offload='nvme' needs nvme_path (a directory on the NVMe drive)")
    if not os.path.isdir(nvme_path):
        raise FileNotFoundError(f"nvme_path {os.fspath(nvme_path)!r} is not a directory")
    return os.fspath(nvme_path)


def speculates_by_default(device: torch.device) -> bool:
    """speculative_updates=None: on a GPU, updates run during backward (the CPU is free while
    the GPU computes). On CPU tensors they wait for step(): there the update would compete with
    backward for the same cores (on a quiet 2-core machine overlapping saved nothing:
    bench/torch_optimizer.py), and the speculative states' second buffer costs a copy of the
    states in host memory."""
    return device.type == "cuda"


def default_cpu_threads(device: torch.device) -> int:
    """cpu_threads=0: every core beside a GPU; half of them on CPU tensors, whose forward and
    backward torch runs on every core. The update splits its work statically across its
    threads, so one thread descheduled by other work on the machine holds the rest up; on a
    2-core machine beside two busy processes (bench/contention.py) train_gpt's step took 1.6x
    torch AdamW's with two threads and 1.2x with one. The update is memory-bound, so half the
    cores lose little on a quiet machine."""
    if device.type == "cuda":
        return 0  # The engine's default: the hardware threads.
    return max(1, len(os.sched_getaffinity(0)) // 2)


def rechecks_gradients(device: torch.device) -> bool:
    """Whether the engine reads the gradients again at step() (optimizer.recheck_gradients):
    on CPU tensors, which the engine reads in place."""
    return device.type == "cpu"


def auto_chunk_bytes(working_bytes: int) -> int:
    """chunk_size="auto" for a model of `working_bytes` (see _AUTO_CHUNKS): a multiple of 4 KiB,
    as the engine requires."""
    per_chunk = -(-working_bytes // _AUTO_CHUNKS)
    return min(_MAX_AUTO_CHUNK, max(4096, -(-per_chunk // 4096) * 4096))


def _refuse_own_keys(owner: str, config: dict[str, Any], path: tuple[str, ...] = ()) -> None:
    for key, value in config.items():
        here = (*path, key)
        if here in _OWN_KEYS:
            raise ValueError(
                f"config key '{'.'.join(here)}' is set by {owner} (from {_OWN_KEYS[here]}); "
                "leave it out of config"
            )
        if isinstance(value, dict):
            _refuse_own_keys(owner, value, here)


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    """Deep-merges `extra` (a Strata-format config fragment) into `into`."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
