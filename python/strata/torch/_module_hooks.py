"""What module and autograd hooks need: a hook that holds its target weakly (hooks left on a
model keep nothing alive), and the tensors in a module's output, wherever they sit in it."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree


class WeakHook:
    """Calls `target.<method>(bound, *args)` while `target` lives; nothing after."""

    def __init__(self, target: Any, method: str, bound: Any) -> None:
        self._target = weakref.ref(target)
        self._method = method
        self._bound = bound

    def __call__(self, *args: Any) -> Any:
        target = self._target()
        if target is not None:
            return getattr(target, self._method)(self._bound, *args)
        return None


def map_tensors(output: Any, fn: Any) -> Any:
    """`output` with `fn` applied to each tensor in it: in pytree's containers (HF's
    ModelOutput registers itself) and dataclasses' fields."""
    leaves, spec = pytree.tree_flatten(output)
    mapped = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = fn(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = {f.name: map_tensors(getattr(leaf, f.name), fn)
                      for f in dataclasses.fields(leaf) if f.init}
            if any(v is not getattr(leaf, k) for k, v in fields.items()):
                leaf = dataclasses.replace(leaf, **fields)
        mapped.append(leaf)
    return pytree.tree_unflatten(mapped, spec)


def tensors_in(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (as map_tensors finds them)."""
    found: list[torch.Tensor] = []
    map_tensors(output, lambda t: found.append(t) or t)
    return found
