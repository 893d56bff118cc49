"""The mirrored layouts: the engine holds a part of each parameter and keeps a mirror of it in
its chunk, since the parameter's memory is someone else's.

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

Both take the gradient norm for ``max_grad_norm`` themselves (the engine sees one rank's part of
the gradients). Collectives go through the process group the trainer initialised (gloo on CPU
tensors), from the trainer's thread inside ``step()`` and ``state_dict()``, which every rank
calls alike.

A rank's part may be empty (a dimension smaller than the world size: FSDP2 gives the last ranks
nothing). The engine registers no empty parameter, so such a part stands in the chunk as one
element that no gradient reaches and nobody reads.
"""

from __future__ import annotations

from typing import Any

import torch

from strata.torch._dtensor import DTensor, dist, is_dtensor
from strata.torch._resident import Resident


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


class _Mirrored(Resident):
    mirrors = True
    engine_clips = False

    def __init__(self, params: list[torch.Tensor], *, max_grad_norm: float,
                 **resident: Any) -> None:
        super().__init__(params, **resident)
        self._max_grad_norm = max_grad_norm

    def _adopt_view(self, p: torch.Tensor, view: torch.Tensor) -> None:
        pass  # The chunk copies the parameter's part.

    def _copy_gradient(self, i: int, p: torch.Tensor, view: torch.Tensor) -> None:
        # The gradient is FSDP2's or DDP's (they accumulate into it): the chunk gets a copy.
        view.copy_(self.local(i, p.grad))
        self._body.state.placed_gradient[i] = p.grad

    def _holds_placed_gradient(self, i: int) -> bool:
        grad = self._params[i].grad
        return grad is not None and grad is self._body.state.placed_gradient.get(i)

    def _replaced(self, p: torch.Tensor, view: torch.Tensor) -> bool:
        return False  # A mirrored parameter's memory is not the chunk's: only values change.

    def grad_norm(self) -> float | None:
        # torch.nn.utils all-reduces the norm of DTensor gradients over their process group;
        # whole gradients (StateShards) have the same norm on every rank without one.
        params = [self._params[i] for i in self.table.trained]
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if self._max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self._max_grad_norm, norm)
        return float(norm.full_tensor() if is_dtensor(norm) else norm)

    def finish_step(self, report: dict[str, Any], grad_norm: float | None) -> None:
        self.publish(self.table.trained)
        self.mark_versions()
        report["grad_norm"] = grad_norm

    def masters_written(self) -> None:
        # Masters rewrite the chunks' working values. Every rank's part only: a write need not
        # happen on every rank (a parameter loaded on one), so no collective.
        self.publish_local()
        self.mark_versions()

    def _views(self) -> list[torch.Tensor]:
        return [r.view for r in self.table.records]

    def publish(self, trained: list[int]) -> None:
        """The chunks' values into the parameters, whole on every rank that holds them; those
        of `trained` gathered across ranks where parts are (a frozen parameter never changes).
        Collective then."""
        self.publish_local()

    def publish_local(self) -> None:
        """This rank's parts only, no collective."""
        with torch.no_grad():
            for r, p in zip(self.table.records, self._params):
                self.local(r.index, p).copy_(self._mirror_of(r.view, p))

    def _mirror_of(self, view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return view


class Fsdp2Shards(_Mirrored):
    _backward_count_hint = (
        ". Under FSDP2 with set_requires_gradient_sync(False) the gradient hooks run once per "
        "step, after the reduce-scatter: leave it at 'auto' there")

    def local(self, i: int, t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if is_dtensor(t) else t

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

    def __init__(self, params: list[torch.Tensor], **mirrored: Any) -> None:
        super().__init__(params, **mirrored)
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        # ranges[r][i]: rank r's (start, end) of parameter i.
        self._ranges = [[self._range(r, p.numel()) for p in params] for r in range(self._world)]

    def _range(self, rank: int, numel: int) -> tuple[int, int]:
        per = -(-numel // self._world)
        return min(rank * per, numel), min((rank + 1) * per, numel)

    def local(self, i: int, t: torch.Tensor) -> torch.Tensor:
        start, end = self._ranges[self._rank][i]
        return _flat(t)[start:end]

    def _mirror_of(self, view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return view.reshape(-1)

    def publish(self, trained: list[int]) -> None:
        if self._world == 1:
            self.publish_local()
            return
        records = self.table.records
        with torch.no_grad():
            self._gather(trained, [records[i].view.reshape(-1) for i in trained],
                         [_flat(self._params[i]) for i in trained])

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
