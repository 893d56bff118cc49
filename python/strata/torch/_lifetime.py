"""Who owns a parameter's memory, and what happens to it when its optimizer goes away.

A parameter's ``.data`` views its engine's chunk while its optimizer lives. When the optimizer
is collected, its parameters (and gradients) get memory of their own and its hooks go, so the
engine is freed with the optimizer and the model trains on with plain tensors. At interpreter
exit the same happens first, then each engine stops its threads and removes its NVMe files:
exit handlers that run later (registered before the first optimizer) still find valid
parameters.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any

import torch

# id(parameter) -> (the parameter, the optimizer that drives it), both weakly. Keyed by id:
# tensors compare elementwise, so they cannot be dictionary keys themselves.
_owners: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_live: weakref.WeakSet = weakref.WeakSet()
_exit_registered = False


def claim(optimizer: Any, params: list[torch.Tensor]) -> None:
    """Registers `optimizer` as the driver of `params`; ValueError when a live optimizer
    already drives one of them (both would pull .data to their own engine)."""
    for key in [k for k, (p, o) in _owners.items() if p() is None or o() is None]:
        del _owners[key]
    for i, p in enumerate(params):
        param, owner = _owners.get(id(p), (lambda: None, lambda: None))
        if param() is p and owner() is not None:
            raise ValueError(
                f"parameter {i} (shape {tuple(p.shape)}) is already driven by another "
                f"{type(owner()).__name__}, which is still alive; delete it first (del opt, "
                "and its scheduler) so that it gives its parameters back"
            )
    for p in params:
        _owners[id(p)] = (weakref.ref(p), weakref.ref(optimizer))


def watch(optimizer: Any, params: list[torch.Tensor], hooks: list[Any],
          chunks: list[torch.Tensor]) -> weakref.finalize:
    """Gives `params` back their own memory when `optimizer` is collected; at exit,
    `optimizer._release_at_exit()` runs (it calls the returned finalizer, then stops the
    engine)."""
    global _exit_registered
    storages = {c.untyped_storage().data_ptr() for c in chunks}
    refs = [weakref.ref(p) for p in params]
    finalizer = weakref.finalize(optimizer, detach, refs, hooks, storages)
    _live.add(optimizer)
    if not _exit_registered:
        # Registered after the finalizers' own exit hook, so it runs first (atexit is LIFO).
        atexit.register(_at_exit)
        _exit_registered = True
    return finalizer


def detach(refs: list[weakref.ref], hooks: list[Any], storages: set[int]) -> None:
    """Points every parameter still viewing one of `storages` (and its gradient) at a copy,
    and removes the optimizer's hooks."""
    for handle in hooks:
        handle.remove()
    hooks.clear()
    with torch.no_grad():
        for ref in refs:
            p = ref()
            if p is None:
                continue
            if p.untyped_storage().data_ptr() in storages:
                p.data = p.data.clone()
            if p.grad is not None and p.grad.untyped_storage().data_ptr() in storages:
                p.grad = p.grad.clone()


def _at_exit() -> None:
    for optimizer in list(_live):
        optimizer._release_at_exit()
