"""The parameters an optimizer drives, one record each: what is known of parameter i (its
group, whether it trains, where the engine keeps it, the views of its place in its chunk) lives
in ``ParamTable.records[i]``, numbered in param_groups order, which is also state_dict's.

The table is built at construction (its checks raise before anything changes) and completed
once the engine has laid the parameters out (``locate``); layouts fill in the views. Only the
optimizer and its layout write to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from strata.torch._dtensor import is_dtensor
from strata.torch._options import WORKING_DTYPES


@dataclasses.dataclass(eq=False)
class ParamRecord:
    """Parameter `index`'s facts."""

    index: int
    group: int     # Its param_groups index.
    trained: bool  # requires_grad at construction: the engine packs frozen ones apart.
    chunk: int = -1   # Its chunk, offset and element count in the engine (locate()).
    offset: int = 0
    numel: int = 0    # Its part's elements, or 1 for an empty part's stand-in.
    # Its place in its chunk, shaped as its part (Layout.local): what .data and .grad view, or
    # what they are copied to and from (mirrored layouts). None where the chunk does not stay
    # on the device (offloaded parameters).
    view: torch.Tensor | None = None
    grad_view: torch.Tensor | None = None
    # Its part's version counter when the engine last wrote it: what finds writes to it.
    version: int = 0

    def name(self, p: torch.Tensor) -> str:
        return f"parameter {self.index} (shape {tuple(p.shape)})"


class ParamTable:
    """The optimizer's parameters and their records, chunk membership included."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        self.params: list[torch.nn.Parameter] = [p for g in param_groups for p in g["params"]]
        groups = [gi for gi, g in enumerate(param_groups) for _ in g["params"]]
        _check_parameters(self.params, groups)
        self.records = [ParamRecord(i, gi, p.requires_grad)
                        for i, (p, gi) in enumerate(zip(self.params, groups))]
        self.device: torch.device = self.params[0].device
        self.dtype: torch.dtype = self.params[0].dtype
        self.trained = [r.index for r in self.records if r.trained]
        # Per chunk: its trained parameters, and all of its parameters (locate()).
        self.members: list[list[int]] = []
        self.in_chunk: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.params)

    def locate(self, location: Any, chunk_count: int) -> None:
        """Records where the engine put each parameter (`location(i)`: chunk, offset, numel)."""
        self.members = [[] for _ in range(chunk_count)]
        self.in_chunk = [[] for _ in range(chunk_count)]
        for r in self.records:
            r.chunk, r.offset, r.numel = location(r.index)
            self.in_chunk[r.chunk].append(r.index)
            if r.trained:
                self.members[r.chunk].append(r.index)

    def chunk_of(self, i: int) -> int:
        return self.records[i].chunk

    def engine_numel(self) -> list[int]:
        return [r.numel for r in self.records]


def _check_parameters(params: list[torch.Tensor], groups: list[int]) -> None:
    first = params[0]
    for i, p in enumerate(params):
        name = f"parameter {i} (shape {tuple(p.shape)}, group {groups[i]})"
        if not isinstance(p, torch.Tensor) or not p.is_leaf:
            raise ValueError(f"{name} is not a leaf tensor; only leaves can be optimized")
        if p.device != first.device:
            raise ValueError(
                f"{name} is on {p.device} but parameter 0 is on {first.device}: one optimizer "
                "drives one device; move the model with model.to(device) first"
            )
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {p.device}; parameters on cpu or cuda only")
        if p.dtype not in WORKING_DTYPES:
            raise ValueError(f"{name} is {p.dtype}; parameters of float32, bfloat16 or float16")
        if p.dtype != first.dtype:
            raise ValueError(
                f"{name} is {p.dtype} but parameter 0 is {first.dtype}: the engine keeps "
                "one working dtype (and fp32 masters); cast the model with model.to(dtype)"
            )
        if p.is_sparse:
            raise ValueError(f"{name} is sparse; dense parameters only")
        if is_dtensor(p) != is_dtensor(first):
            raise ValueError(
                f"{name} is {'' if is_dtensor(p) else 'not '}a DTensor but "
                f"parameter 0 is {'' if is_dtensor(first) else 'not'}: shard the "
                "whole model with fully_shard (FSDP2), or none of it")


def flat_fp32(part: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """A parameter's part (Layout.local) as a flat, contiguous fp32 host tensor of the
    engine's numel: an empty part's stand-in is one zero."""
    if part.numel() == 0:
        return torch.zeros(1)
    return part.detach().reshape(-1).to("cpu", torch.float32, copy=copy).contiguous()


def keep_master_bits(masters: list[torch.Tensor], values: list[torch.Tensor],
                     dtype: torch.dtype) -> list[torch.Tensor]:
    """New fp32 values for masters, from a model of working dtype `dtype`: a value that is its
    master rounded keeps the master's fp32 bits, so writing back what was read (an EMA swap and
    back, a save and load of the model) keeps training exactly."""
    return [torch.where(m.to(dtype).float() == v, m, v) for m, v in zip(masters, values)]
