"""Parameters sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): ``DTensor``s whose
local shard is all a rank holds and updates.

FSDP2 owns a sharded parameter's memory: it all-gathers from its own padded buffer, which the
local tensor views, so the engine cannot lay such a parameter out in its chunks the way it does
a plain one (``.data`` as a view of the chunk). Instead the chunk keeps a mirror: the local
shard's values are registered, its gradient is copied in when handed over, and the updated
values are copied back after every step. Each rank's engine then holds and updates 1/N of the
model, and the only cross-rank work an optimizer step needs is the gradient norm, which
``torch.nn.utils`` all-reduces over the ``DTensor`` gradients through the process group the
trainer initialised.

A rank's shard may be empty (a dimension smaller than the world size: FSDP2 gives the last
ranks nothing). The engine registers no empty parameter, so such a shard stands in the chunk as
one element that no gradient reaches and nobody reads.
"""

from __future__ import annotations

import math
from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None


def is_sharded(t: torch.Tensor | None) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard (a view), or `t` itself."""
    return t.to_local() if is_sharded(t) else t


def engine_shape(p: torch.Tensor) -> list[int]:
    """The shape the engine registers for `p`'s local part: one element stands for an empty
    shard (and for a 0-dimensional parameter)."""
    shape = list(local(p).shape)
    return shape if shape and math.prod(shape) > 0 else [1]


def as_parameter_state(values: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state read from the engine (flat, the engine's numel) shaped as parameter `p`: for a
    sharded `p`, a DTensor on its mesh and placements holding this rank's shard, which is what
    torch AdamW keeps for it and what ``torch.distributed.checkpoint`` reshards."""
    mine = local(p)
    values = values[: mine.numel()].view(mine.shape)
    if not is_sharded(p):
        return values
    return DTensor.from_local(values, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def local_state(values: Any, p: torch.Tensor, engine_numel: int) -> torch.Tensor:
    """A state given for parameter `p` (a DTensor of its sharding, or this rank's or the whole
    parameter's values as one tensor) as the flat fp32 host tensor the engine takes. Raises
    ValueError naming the sizes when it fits neither."""
    tensor = torch.as_tensor(values).detach()
    if is_sharded(tensor):
        if is_sharded(p) and tensor.placements != p.placements:
            tensor = tensor.redistribute(p.device_mesh, p.placements)
        tensor = tensor.to_local()
    tensor = tensor.to("cpu", torch.float32).reshape(-1).contiguous()
    mine = local(p).numel()
    if tensor.numel() != mine:
        whose = "this rank's shard of the parameter" if is_sharded(p) else "the parameter"
        raise ValueError(f"has {tensor.numel()} elements; {whose} has {mine}")
    if mine < engine_numel:  # An empty shard's stand-in.
        tensor = torch.zeros(engine_numel)
    return tensor


def global_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """The gradients' 2-norm over every rank (torch.nn.utils all-reduces it over the DTensors'
    process group), clipping them in place to `max_norm` (> 0) as ``clip_grad_norm_`` does:
    multiplied by min(max_norm / (norm + 1e-6), 1), so by exactly 1 when they are not clipped.
    Collective: every rank calls it at the same step."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    if is_sharded(norm):
        norm = norm.full_tensor()
    return float(norm)
