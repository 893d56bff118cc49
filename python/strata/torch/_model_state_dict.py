"""``model.state_dict()`` and ``model.load_state_dict()`` on a model whose parameters are
offloaded (_residency.py): module hooks give the parameters their values from the engine's
masters around a call, and write loaded values back as masters.

A call is a session from its outermost module's pre-hook to its post-hook (a parent's runs
before its children's hooks and after them): a parameter lent once in it keeps its tensor to
the end, so tied weights share one. A parameter filled for a module running now (a state_dict
taken inside a forward) is read where it is.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from strata.torch._module_hooks import WeakHook
from strata.torch._params import keep_master_bits

if TYPE_CHECKING:
    from strata.torch._residency import ParameterResidency


class ModelStateDictSessions:
    def __init__(self, residency: ParameterResidency) -> None:
        self._residency = weakref.proxy(residency)  # Which holds these sessions.
        # The parameters given memory of their own in this session (a dict: ordered, fast to
        # look up), those read where a running module filled them, and the hooks still open.
        self._session: dict[int, None] = {}
        self._session_in_use: dict[int, None] = {}
        self._depth = 0

    def install(self, module: torch.nn.Module, own: list[int]) -> list[Any]:
        """The hooks of `module`, which owns parameters `own`."""
        return [module.register_state_dict_pre_hook(WeakHook(self, "_before_state_dict", own)),
                module.register_state_dict_post_hook(WeakHook(self, "_after_state_dict", own)),
                module.register_load_state_dict_pre_hook(WeakHook(self, "_before_load", own)),
                module.register_load_state_dict_post_hook(WeakHook(self, "_after_load", own))]

    def lent(self, i: int) -> bool:
        """Parameter i has memory of its own for this session."""
        return i in self._session

    def interrupted(self) -> None:
        """A state_dict call that raised: its lent parameters get their stand-ins back."""
        if self._depth:
            self._depth = 1
            self._give_back(self._end_session()[0])

    def _give_back(self, lent: list[int]) -> None:
        residency = self._residency
        for i in lent:
            residency.params[i]().data = residency.absent[i]

    def _lend(self, own: list[int]) -> None:
        """Gives `own`'s parameters memory of their own holding their values, for one module's
        part of the call."""
        residency = self._residency
        self._depth += 1
        fresh = []
        for i in own:
            if i in self._session or i in self._session_in_use:
                continue
            if residency.uses[residency.chunk_of(i)] > 0:
                self._session_in_use[i] = None
            else:
                fresh.append(i)
        for i, value in zip(fresh, residency.read_masters(fresh)):
            residency.params[i]().data = value.to(residency.device, residency.dtype).view(
                residency.shapes[i])
            self._session[i] = None

    def _end_session(self) -> tuple[list[int], list[int]]:
        """One module's part is done; at the session's end, the parameters it lent (to be
        given their stand-ins back by the caller) and those it read where they were filled."""
        self._depth -= 1
        if self._depth > 0:
            return [], []
        lent, in_use = list(self._session), list(self._session_in_use)
        self._session.clear()
        self._session_in_use.clear()
        return lent, in_use

    def _before_state_dict(self, own: list[int], module: Any, prefix: str,
                           keep_vars: bool) -> None:
        self._lend(own)

    def _after_state_dict(self, own: list[int], module: Any, state_dict: Any, prefix: str,
                          local_metadata: Any) -> None:
        # Entries of parameters filled for a running module view storage emptied when it
        # returns: they get copies.
        index = self._residency.index
        for name, p in module._parameters.items():
            i = index.get(id(p)) if p is not None else None
            key = prefix + name
            if (i is not None and i in self._session_in_use and key in state_dict
                    and state_dict[key] is not p):
                state_dict[key] = state_dict[key].clone()
        self._give_back(self._end_session()[0])

    def _before_load(self, own: list[int], module: Any, *args: Any) -> None:
        self._lend(own)

    def _after_load(self, own: list[int], module: Any, incompatible_keys: Any) -> None:
        lent, in_use = self._end_session()
        done = lent + in_use
        if not done:
            return
        residency = self._residency
        values = [residency.params[i]().detach().reshape(-1).to("cpu", torch.float32)
                  for i in done]
        if residency.dtype != torch.float32:
            # A value that rounds from its master keeps the master's fp32 bits (a save and
            # load of the same model keeps training exactly).
            values = keep_master_bits(residency.read_masters(done), values, residency.dtype)
        try:
            residency.write_masters(done, values)
        finally:
            self._give_back(lent)
