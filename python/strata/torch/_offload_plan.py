"""``offload_parameters(model, ...)``: a model marked to keep its parameters off the device
between uses (ZeRO-3's ``offload_param``), and what the engine's config gets for it. The
strata optimizer built on the model's parameters finds the plan (plan_of) and lays them out
with the Offloaded layout (_offloaded.py); until then the model is untouched."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from strata.torch import _native
from strata.torch._options import nvme_directory, tier_of

# id(parameter) -> (the parameter, held weakly; its model's plan, which holds the model weakly).
_planned: dict[int, tuple[weakref.ref, "OffloadPlan"]] = {}


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """What offload_parameters() asked for one model."""

    tier: str                  # The engine's placement.params: "host" or "nvme".
    nvme_path: str | None
    device_memory: int | None  # Bytes of the engine's device budget; None = the engine's own.
    model: weakref.ref


def offload_parameters(model: torch.nn.Module, offload: str = "cpu", *,
                       nvme_path: Any = None,
                       device_memory: int | str | None = None) -> torch.nn.Module:
    """Keeps ``model``'s parameters in host memory (``offload="cpu"``) or on NVMe
    (``offload="nvme"``, under ``nvme_path``) between uses, as DeepSpeed's ZeRO-3
    ``offload_param`` does: the device holds a module's parameters while it runs, fetched ahead
    in the order the first step recorded, and their gradients leave it as soon as backward has
    produced them. ``device_memory`` (bytes, or "2GiB") bounds the engine's device copies of
    parameters and gradients.

    Call it before building the optimizer, which does the offloading (a strata optimizer over
    ``model.parameters()``); until then the model is untouched. Every parameter must be used
    inside the forward of a module that owns it (as FSDP requires). Returns ``model``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload_parameters takes an nn.Module, got {type(model).__name__}")
    tier = tier_of(offload, device_allowed=False)
    if tier == "nvme":
        nvme_path = nvme_directory(nvme_path)
    if device_memory is not None:
        device_memory = (_native.parse_bytes(device_memory) if isinstance(device_memory, str)
                         else int(device_memory))
        if device_memory <= 0:
            raise ValueError(f"device_memory must be positive, got {device_memory}")
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters to offload")
    plan = OffloadPlan(tier, nvme_path, device_memory, weakref.ref(model))
    for p in params:
        _planned[id(p)] = (weakref.ref(p), plan)
    return model


def plan_of(params: list[torch.Tensor]) -> OffloadPlan | None:
    """The plan that covers `params` (an optimizer's), None when none does. ValueError when
    only some are covered, or by different models' plans."""
    for key in [k for k, (p, plan) in _planned.items() if p() is None or plan.model() is None]:
        del _planned[key]
    plans = []
    for p in params:
        ref, plan = _planned.get(id(p), (lambda: None, None))
        plans.append(plan if ref() is p else None)
    if all(plan is None for plan in plans):
        return None
    first = next(plan for plan in plans if plan is not None)
    for i, plan in enumerate(plans):
        if plan is not first:
            raise ValueError(
                f"parameter {i} (shape {tuple(params[i].shape)}) is "
                + ("not in the model given to offload_parameters()" if plan is None
                   else "in another model given to offload_parameters()")
                + ": build the optimizer over that one model's parameters")
    return first


def place(options: dict[str, Any], plan: OffloadPlan, accumulation: int) -> None:
    """The engine's config (engine_options') for offloaded parameters: their home, the device
    budget, and the engine summing `accumulation` micro-steps (the parameters' gradient buffers
    do not outlive a backward pass, so torch cannot accumulate in .grad)."""
    placement = options["placement"]
    placement["params"] = plan.tier
    optimizer = options["optimizer"]
    optimizer["gradient_accumulation_steps"] = accumulation
    # The recheck reads gradient buffers that stay where the trainer keeps them; offloaded
    # chunks' leave the device with each backward pass. Gradients go over when final instead.
    optimizer["recheck_gradients"] = False
    if plan.tier == "nvme":
        paths = options.setdefault("nvme", {}).setdefault("paths", [plan.nvme_path])
        if plan.nvme_path not in paths:
            raise ValueError(
                f"offload_parameters' nvme_path {plan.nvme_path!r} differs from the optimizer's "
                f"{paths}: the engine keeps one set of NVMe paths; give both the same")
    if plan.device_memory is not None:
        key = "cuda_memory_bytes" if options["device"]["kind"] == "cuda" else \
            "host_device_memory_bytes"
        options["device"][key] = plan.device_memory
