"""Which layout (_layout.py) an optimizer's parameters get: offloaded when offload_parameters
marked their model, FSDP2's shards when they are DTensors, 1/N slices with shard_states,
resident otherwise. A new layout is a file of its own and a branch here."""

from __future__ import annotations

import torch

from strata.torch._dtensor import dist, is_dtensor, world_size
from strata.torch._layout import Layout
from strata.torch._mirrored import Fsdp2Shards, StateShards
from strata.torch._offload_plan import plan_of
from strata.torch._offloaded import Offloaded
from strata.torch._resident import Resident


def choose(params: list[torch.Tensor], *, shard_states: bool,
           gradient_accumulation_steps: int | str, overlap: bool,
           max_grad_norm: float) -> Layout:
    several = world_size() > 1
    first = params[0]
    if first.device.type != "cpu" and (several or shard_states or is_dtensor(first)):
        raise NotImplementedError(
            "strata.torch across several ranks runs on CPU tensors (the gloo backend) so far; "
            "on GPUs (FSDP2, DDP, shard_states) it is not built yet")
    if (is_dtensor(first) or shard_states) and first.dtype == torch.float16:
        raise NotImplementedError(
            "fp16 parameters with FSDP2 or shard_states are not built yet: each rank's engine "
            "sees part of the gradients, so the loss scale's overflow check and the norm would "
            "disagree across ranks; train in bf16 (or fp32)")
    if shard_states and not is_dtensor(first):
        _check_shardable(params)
    plan = plan_of(params)
    if plan is not None:
        if is_dtensor(first) or shard_states or several:
            raise NotImplementedError(
                "offload_parameters across several ranks (FSDP2, DDP, shard_states) is not "
                "built yet: offloaded parameters work on one rank")
        return Offloaded(params, plan, gradient_accumulation_steps=gradient_accumulation_steps)
    resident = {"gradient_accumulation_steps": gradient_accumulation_steps, "overlap": overlap}
    if is_dtensor(first):
        return Fsdp2Shards(params, max_grad_norm=max_grad_norm, **resident)
    if shard_states:
        return StateShards(params, max_grad_norm=max_grad_norm, **resident)
    return Resident(params, **resident)


def _check_shardable(params: list[torch.Tensor]) -> None:
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "shard_states=True shards the optimizer states across the ranks of the default "
            "process group: call torch.distributed.init_process_group first (torchrun sets "
            "its environment)")
    for i, p in enumerate(params):
        if not p.is_contiguous():
            raise ValueError(
                f"parameter {i} (shape {tuple(p.shape)}) is not contiguous; shard_states "
                "slices parameters as flat memory")
