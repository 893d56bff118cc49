"""torch.distributed's names strata.torch uses, where this torch has them (a torch built
without distributed has neither), and the one question every layout asks of a parameter."""

from __future__ import annotations

from typing import Any

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    dist = None
    DTensor = None


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor (FSDP2's sharded parameters are)."""
    return DTensor is not None and isinstance(t, DTensor)


def world_size() -> int:
    """The default process group's size; 1 without one."""
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()
