"""Which part of each parameter a rank's engine holds and updates (a Layout), and how the
parts come back together.

- ``Whole``: every parameter whole (one rank, or DDP's replicas, each rank running the same
  update). The chunks are the parameters' memory: ``.data`` views them.
- ``Fsdp2Shards``: parameters sharded by FSDP2 (``fully_shard``), ``DTensor``s whose local shard
  is all a rank holds. FSDP2 owns that memory (it all-gathers from its own padded buffer, which
  the local tensor views), so the chunk keeps a mirror: the shard's values are registered, its
  gradient is copied in when handed over, and the updated values are copied back after each
  step. States are DTensors of the parameter's sharding, as torch AdamW's are under FSDP2, so
  ``torch.distributed.checkpoint`` reshards them.
- ``StateShards`` (``shard_states=True``, ZeRO stage 1): whole parameters and gradients on every
  rank (DDP averages the gradients), but each rank's engine holds and updates 1/N of each
  parameter (a flat slice), mirrored as above; after the step the trained slices are
  all-gathered into every rank's parameters. ``optimizer.state`` shows this rank's slices;
  whole states, in torch AdamW's format, come from ``consolidate_state_dict()`` on every rank
  (as torch's ZeroRedundancyOptimizer's), after which ``state_dict()`` returns them.

Mirrored layouts take the gradient norm for ``max_grad_norm`` themselves (the engine sees one
rank's part of the gradients). Collectives go through the process group the trainer
initialised (gloo on CPU tensors), from the trainer's thread inside ``step()`` and
``state_dict()``, which every rank calls alike.

A rank's part may be empty (a dimension smaller than the world size: FSDP2 gives the last ranks
nothing). The engine registers no empty parameter, so such a part stands in the chunk as one
element that no gradient reaches and nobody reads.
"""

from __future__ import annotations

import math
from typing import Any

import torch

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    dist = None
    DTensor = None


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


class Layout:
    """Whole: the identity. Subclasses mirror (``mirrors``)."""

    mirrors = False
    # state_dict() needs consolidate_state_dict() first: no rank holds whole states.
    consolidates = False

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = params

    def local(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """The part of parameter i (or of its gradient, `t`) this rank holds: a view."""
        return t

    def engine_shape(self, i: int) -> list[int]:
        """The shape the engine registers for parameter i's part: one element stands for an
        empty part (and for a 0-dimensional parameter)."""
        shape = list(self.local(i, self._params[i]).shape)
        return shape if shape and math.prod(shape) > 0 else [1]

    def grad_norm(self, trained: list[int], max_norm: float) -> float | None:
        """Mirrored: the gradients' 2-norm over the whole model, clipping them in place to
        `max_norm` (> 0) as ``clip_grad_norm_`` does (by exactly 1 when they are not clipped).
        None: the engine measures and clips."""
        return None

    def publish(self, views: list[torch.Tensor], trained: list[int]) -> None:
        """Mirrored: the chunks' values (`views`, each parameter's part) into the parameters,
        whole on every rank that holds them; those of `trained` gathered across ranks where
        parts are (a frozen parameter never changes). Collective then."""

    def publish_local(self, views: list[torch.Tensor]) -> None:
        """Mirrored: this rank's parts only, no collective (after masters were written)."""

    def states(self, indices: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
        """States read from the engine (flat, the engine's numel) as this rank holds them,
        without a collective: shaped as their parameter (as its part, where it has one)."""
        return [self._shaped(i, v) for i, v in zip(indices, values)]

    def local_state(self, i: int, values: Any, engine_numel: int) -> torch.Tensor:
        """A state given for parameter i (whole, or a DTensor of any sharding) as the flat fp32
        host tensor the engine takes for this rank's part. Raises ValueError naming the sizes
        when it fits neither."""
        tensor = torch.as_tensor(values).detach()
        if is_dtensor(tensor):
            tensor = self._local_of_dtensor(i, tensor)
        tensor = tensor.to("cpu", torch.float32).reshape(-1).contiguous()
        expected = self.state_numel(i)
        if tensor.numel() != expected:
            raise ValueError(f"has {tensor.numel()} elements; {self._whose()} has {expected}")
        tensor = self._local_of_whole(i, tensor)
        if tensor.numel() < engine_numel:  # An empty part's stand-in.
            tensor = torch.zeros(engine_numel)
        return tensor

    # What local_state needs, per layout.
    def _shaped(self, i: int, values: torch.Tensor) -> torch.Tensor:
        mine = self.local(i, self._params[i])
        return values[: mine.numel()].view(mine.shape)

    def _local_of_dtensor(self, i: int, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor()

    def state_numel(self, i: int) -> int:
        """Elements of a state local_state takes for parameter i."""
        return self._params[i].numel()

    def _local_of_whole(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def _whose(self) -> str:
        return "the parameter"


class Whole(Layout):
    pass


class _Mirrored(Layout):
    mirrors = True

    def grad_norm(self, trained: list[int], max_norm: float) -> float | None:
        # torch.nn.utils all-reduces the norm of DTensor gradients over their process group;
        # whole gradients (StateShards) have the same norm on every rank without one.
        params = [self._params[i] for i in trained]
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return float(norm.full_tensor() if is_dtensor(norm) else norm)


class Fsdp2Shards(_Mirrored):
    def local(self, i: int, t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if is_dtensor(t) else t

    def publish(self, views: list[torch.Tensor], trained: list[int]) -> None:
        self.publish_local(views)

    def publish_local(self, views: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for i, view in enumerate(views):
                self.local(i, self._params[i]).copy_(view)

    def states(self, indices: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for i, v in zip(indices, values):
            p = self._params[i]
            out.append(DTensor.from_local(self._shaped(i, v), p.device_mesh, p.placements,
                                          run_check=False, shape=p.shape, stride=p.stride()))
        return out

    def _local_of_dtensor(self, i: int, tensor: torch.Tensor) -> torch.Tensor:
        p = self._params[i]
        if tensor.placements != p.placements:
            tensor = tensor.redistribute(p.device_mesh, p.placements)
        return tensor.to_local()

    def state_numel(self, i: int) -> int:
        return self.local(i, self._params[i]).numel()

    def _whose(self) -> str:
        return "this rank's shard of the parameter"


class StateShards(_Mirrored):
    """ZeRO stage 1 over the default process group: rank r holds elements [start, end) of
    every parameter, ceil(numel / world) of them (the last ranks fewer, or none)."""

    consolidates = True

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params)
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        # ranges[r][i]: rank r's (start, end) of parameter i.
        self._ranges = [[self._range(r, p.numel()) for p in params] for r in range(self._world)]

    def _range(self, rank: int, numel: int) -> tuple[int, int]:
        per = -(-numel // self._world)
        return min(rank * per, numel), min((rank + 1) * per, numel)

    def local(self, i: int, t: torch.Tensor) -> torch.Tensor:
        start, end = self._ranges[self._rank][i]
        return _flat(t)[start:end]

    def publish(self, views: list[torch.Tensor], trained: list[int]) -> None:
        if self._world == 1:
            self.publish_local(views)
            return
        with torch.no_grad():
            self._gather(trained, [views[i].reshape(-1) for i in trained],
                         [_flat(self._params[i]) for i in trained])

    def publish_local(self, views: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for i, view in enumerate(views):
                self.local(i, self._params[i]).copy_(view.reshape(-1))

    def whole_states(self, indices: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's slices of these states, whole and shaped as their parameters: a
        collective (one all-gather per call)."""
        whole = [torch.empty(self._params[i].numel()) for i in indices]
        mine = [v[: self._len(self._rank, i)] for i, v in zip(indices, values)]
        self._gather(indices, mine, whole)
        return [w.view(self._params[i].shape) for i, w in zip(indices, whole)]

    def _local_of_whole(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        start, end = self._ranges[self._rank][i]
        return flat[start:end].contiguous()

    def _len(self, rank: int, i: int) -> int:
        start, end = self._ranges[rank][i]
        return end - start

    def _gather(self, indices: list[int], mine: list[torch.Tensor],
                whole: list[torch.Tensor]) -> None:
        """Every rank's parts (`mine`: this rank's, flat, of parameters `indices`) into the
        flat tensors `whole`, in one all-gather of bytes (gloo gathers any dtype so)."""
        if not indices:
            return  # Every rank has the same (empty) list: no collective on any.
        dtype = whole[0].dtype
        sizes = [sum(self._len(r, i) for i in indices) for r in range(self._world)]
        longest = max(sizes)
        send = torch.empty(longest, dtype=dtype)
        send[sizes[self._rank]:].zero_()
        if mine:
            torch.cat([m.to(dtype) for m in mine], out=send[: sizes[self._rank]])
        received = torch.empty(self._world * longest, dtype=dtype)
        dist.all_gather_into_tensor(received.view(torch.uint8), send.view(torch.uint8))
        for r in range(self._world):
            offset = r * longest
            for k, i in enumerate(indices):
                start, end = self._ranges[r][i]
                whole[k][start:end].copy_(received[offset : offset + end - start])
                offset += end - start


def layout(params: list[torch.Tensor], shard_states: bool) -> Layout:
    """The layout for `params`: FSDP2's when they are DTensors, StateShards with
    `shard_states` (which needs torch.distributed initialised), Whole otherwise."""
    several = dist is not None and dist.is_available() and dist.is_initialized() and (
        dist.get_world_size() > 1)
    if params[0].device.type != "cpu" and (several or shard_states or is_dtensor(params[0])):
        raise NotImplementedError(
            "strata.torch across several ranks runs on CPU tensors (the gloo backend) so far; "
            "on GPUs (FSDP2, DDP, shard_states) it is not built yet")
    if (is_dtensor(params[0]) or shard_states) and params[0].dtype == torch.float16:
        raise NotImplementedError(
            "fp16 parameters with FSDP2 or shard_states are not built yet: each rank's engine "
            "sees part of the gradients, so the loss scale's overflow check and the norm would "
            "disagree across ranks; train in bf16 (or fp32)")
    if is_dtensor(params[0]):
        return Fsdp2Shards(params)
    if shard_states:
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
        return StateShards(params)
    return Whole(params)
