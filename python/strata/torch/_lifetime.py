"""Who owns a parameter's memory, and what happens to it when its optimizer goes away.

A parameter's ``.data`` views its engine's chunk while its optimizer drives it. When the
optimizer is collected, closed, or the interpreter exits (weakref.finalize runs at exit too,
before exit handlers registered earlier than the first optimizer), its parameters and gradients
get memory of their own and its hooks go. The engine itself is freed only when nothing views
its memory any more (a state_dict snapshot may), so no tensor ever points at freed memory; its
NVMe swap files go with it, or, if it is still referenced at exit, with the next run's cleanup
of files whose process is gone.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from strata.torch._dtensor import is_dtensor

# id(parameter) -> (the parameter, the optimizer that drives it), both weakly. Keyed by id:
# tensors compare elementwise, so they cannot be dictionary keys themselves.
_owners: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def owners(params: list[torch.Tensor]) -> list[Any]:
    """The live optimizers that drive any of `params`."""
    for key in [k for k, (p, o) in _owners.items() if p() is None or o() is None]:
        del _owners[key]
    found = []
    for p in params:
        param, owner = _owners.get(id(p), (lambda: None, lambda: None))
        if param() is p and owner() is not None and all(owner() is not f for f in found):
            found.append(owner())
    return found


def claim(optimizer: Any, params: list[torch.Tensor]) -> None:
    """Registers `optimizer` as the driver of `params` (once it is fully built)."""
    for p in params:
        _owners[id(p)] = (weakref.ref(p), weakref.ref(optimizer))


def detach(refs: list[weakref.ref], hooks: list[Any], storages: set[int]) -> None:
    """Points every parameter still viewing one of `storages` (and its gradient) at a copy,
    and removes the optimizer's hooks."""
    for handle in hooks:
        handle.remove()
    hooks.clear()
    with torch.no_grad():
        for ref in refs:
            p = ref()
            if p is None or is_dtensor(p):
                continue  # FSDP2's sharded parameters never view a chunk (_mirrored.py).
            if p.untyped_storage().data_ptr() in storages:
                p.data = p.data.clone()
            if p.grad is not None and p.grad.untyped_storage().data_ptr() in storages:
                p.grad = p.grad.clone()
