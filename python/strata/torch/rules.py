"""The update rules: OffloadAdamW, OffloadAdam, OffloadAdagrad and OffloadLion, each mirroring
its torch optimizer's arguments, defaults and state names."""

from __future__ import annotations

from typing import Any

import torch

from strata.torch._native import EXP_AVG, EXP_AVG_SQ
from strata.torch.optimizer import OffloadOptimizer


def _torch_defaults(reference: type[torch.optim.Optimizer], **kwargs: Any) -> dict[str, Any]:
    """The defaults a torch optimizer builds from these arguments, with every key its
    param_groups carry in this torch version (so state_dicts load into it both ways)."""
    return dict(reference([torch.nn.Parameter(torch.zeros(1))], **kwargs).defaults)


def _refuse(name: str, value: Any, supported: Any) -> None:
    if value != supported:
        raise NotImplementedError(f"{name}={value!r} is not built yet (only {supported!r})")


class OffloadAdamW(OffloadOptimizer):
    """torch.optim.AdamW with its states (fp32 master, exp_avg, exp_avg_sq) offloaded.

    Offload options (keyword-only): ``offload`` ("cpu" for host memory, "nvme", or None to keep
    them on the device), ``nvme_path``, ``offload_ratio`` (DeepSpeed's ``ratio``: the fraction
    offloaded), ``max_grad_norm`` (clip on the global norm; 0 = off),
    ``gradient_accumulation_steps`` (backward passes per step; "auto" follows the trainer),
    ``chunk_size`` (bytes of working parameters per chunk: the unit of overlap; "auto"),
    ``host_memory`` (budget; default 80% of RAM),
    ``cpu_threads``, ``loss_scale`` (fp16: "dynamic" or a fixed scale), ``speculative_updates``,
    ``shard_states`` (ZeRO stage 1 under DDP: each rank holds and updates 1/N of the states)
    and ``config`` (a Strata-format config fragment merged over the rest). On FSDP2's sharded
    parameters each rank holds its shards' states by itself.
    """

    _engine_type = "adamw"
    _state_names = {EXP_AVG: "exp_avg", EXP_AVG_SQ: "exp_avg_sq"}

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, **offload: Any) -> None:
        _refuse("amsgrad", amsgrad, False)
        _refuse("maximize", maximize, False)
        defaults = _torch_defaults(torch.optim.AdamW, lr=lr, betas=betas, eps=eps,
                                   weight_decay=weight_decay)
        super().__init__(params, defaults, **offload)


class OffloadAdam(OffloadOptimizer):
    """torch.optim.Adam (L2 weight decay added to the gradient) with its states offloaded; the
    offload options are OffloadAdamW's."""

    _engine_type = "adam"
    _state_names = {EXP_AVG: "exp_avg", EXP_AVG_SQ: "exp_avg_sq"}

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 maximize: bool = False, **offload: Any) -> None:
        _refuse("amsgrad", amsgrad, False)
        _refuse("maximize", maximize, False)
        defaults = _torch_defaults(torch.optim.Adam, lr=lr, betas=betas, eps=eps,
                                   weight_decay=weight_decay)
        super().__init__(params, defaults, **offload)


class OffloadAdagrad(OffloadOptimizer):
    """torch.optim.Adagrad (lr_decay 0, initial_accumulator_value 0) with its sum of squares
    offloaded; the offload options are OffloadAdamW's."""

    _engine_type = "adagrad"
    _state_names = {EXP_AVG_SQ: "sum"}

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, *,
                 maximize: bool = False, **offload: Any) -> None:
        _refuse("lr_decay", lr_decay, 0.0)
        _refuse("initial_accumulator_value", initial_accumulator_value, 0.0)
        _refuse("maximize", maximize, False)
        defaults = _torch_defaults(torch.optim.Adagrad, lr=lr, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, **offload)


class OffloadLion(OffloadOptimizer):
    """Lion (Chen et al. 2023; torch has none) with its momentum offloaded; the offload options
    are OffloadAdamW's. Lion's lr is typically 3-10x smaller than AdamW's."""

    _engine_type = "lion"
    _state_names = {EXP_AVG: "exp_avg"}

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, **offload: Any) -> None:
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        super().__init__(params, defaults, **offload)
