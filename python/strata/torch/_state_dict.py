"""An optimizer's states in torch.optim's format: per parameter index its ``step`` and moments,
named as the matching torch optimizer names them (so either state_dict loads into the other),
plus ``master`` (the fp32 master value) when the parameters are not fp32. The engine's states
are read and written in one batch per kind, through the layout (_layout.py), which shapes
them as this rank holds them.

``States`` is what state_dict(), load_state_dict() and ``optimizer.state`` (``StateView``) go
through; it refuses access while a step is open.
"""

from __future__ import annotations

import weakref
from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from typing import TYPE_CHECKING, Any

import torch

from strata.torch._native import MASTER

if TYPE_CHECKING:
    from strata.torch._step import StepBody


class States:
    def __init__(self, body: StepBody, names: dict[int, str]) -> None:
        self._body = body
        # state kind -> torch's name of it, the master's included where there is one.
        self.names = dict(names)
        if body.table.dtype != torch.float32:
            self.names[MASTER] = "master"
        self._rule_names = names  # Without the master: what a fresh parameter starts with.

    def read(self, indices: list[int], what: str,
             whole: bool = False) -> dict[int, dict[str, torch.Tensor]]:
        """Parameter index -> its step and states, one engine read per kind; as the layout
        gives them (whole, DTensors under FSDP2, this rank's slices with shard_states unless
        `whole`, which gathers them: a collective)."""
        body = self._body
        body.check_between_steps(what)
        layout = body.layout
        steps = torch.tensor(float(body.native.step_count))
        out: dict[int, dict[str, torch.Tensor]] = {i: {"step": steps.clone()} for i in indices}
        for kind in sorted(self.names):
            read = layout.read_states([(i, kind) for i in indices])
            shaped = (layout.whole_states(indices, read) if whole
                      else layout.states(indices, read))
            for i, state in zip(indices, shaped):
                out[i][self.names[kind]] = state
        return out

    def pack(self, param_groups: list[dict[str, Any]], what: str,
             whole: bool = False) -> dict[str, Any]:
        """The state_dict, between steps. Every trained parameter has its states, from
        construction on (zero moments at step 0, which torch AdamW's first step starts from
        too): torch.distributed.checkpoint loads only what the target's state_dict lists."""
        state = self.read(self._body.table.trained, what, whole)
        groups = []
        first = 0
        for g in param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(first, first + len(g["params"])))
            first += len(g["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def unpack(self, param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
        """Loads `state_dict`, between steps; every entry is checked before anything is
        written."""
        body = self._body
        body.check_between_steps("load_state_dict()")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(param_groups):
            raise ValueError(
                f"the state_dict has {len(saved_groups)} parameter groups; this optimizer has "
                f"{len(param_groups)}")
        for gi, (mine, saved) in enumerate(zip(param_groups, saved_groups)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(
                    f"parameter group {gi} of the state_dict has {len(saved['params'])} "
                    f"parameters; this optimizer's has {len(mine['params'])}")
            for flag in ("amsgrad", "maximize"):
                if saved.get(flag, False):
                    raise NotImplementedError(
                        f"parameter group {gi} of the state_dict has {flag}=True, which "
                        f"{body.owner} does not build")
            body.settings.check_saved(gi, saved, body.owner)
        index_of = {}
        first = 0
        for saved in saved_groups:
            for position, saved_index in enumerate(saved["params"]):
                index_of[saved_index] = first + position
            first += len(saved["params"])
        unknown = [k for k in state_dict["state"] if k not in index_of]
        if unknown:
            raise ValueError(f"the state_dict has state for parameters {unknown}, which none of "
                             "its param_groups lists")
        saved_state = {index_of[k]: v for k, v in state_dict["state"].items()}
        layout = body.layout
        steps = 0
        writes = []
        for i in body.table.trained:
            entry = saved_state.get(i, {})
            for kind, name in [(MASTER, "master"), *self._rule_names.items()]:
                if name in entry:
                    writes.append((i, kind, entry[name], name))
                elif kind != MASTER:
                    writes.append((i, kind, torch.zeros(layout.state_numel(i)), name))
            if "step" in entry:
                steps = max(steps, int(float(entry["step"])))
        # Every entry is checked before anything is written; then the values the model loaded
        # become the masters, then the saved states go in. Every parameter is compared, not only
        # those whose version counter moved: torch.distributed.checkpoint's load writes into the
        # parameters without moving it.
        batch = layout.state_batch(writes)
        layout.adopt_parameter_changes(everything=True)
        layout.write_state_batch(batch)
        body.native.set_step_count(steps)
        for mine, saved in zip(param_groups, saved_groups):
            for key, value in saved.items():
                if key != "params":
                    mine[key] = value
        layout.mark_versions()


class StateView(Mapping):
    """``optimizer.state`` as torch code reads it (torch.distributed.checkpoint's
    get_state_dict, Lightning moving states to a device): each trained parameter -> its step
    and states, read from the engine at each access, as this rank holds them (with
    shard_states, its slices: reading never takes a collective). Copies: writing to them
    changes nothing (load_state_dict writes). Non-empty from construction on, so
    get_state_dict does not take the optimizer for a fresh torch one and run a step with zero
    gradients to create states."""

    def __init__(self, states: States, params: list[torch.Tensor], trained: list[int]) -> None:
        # Held weakly, as the optimizer holds its view: no cycle to delay close.
        self._states = weakref.ref(states)
        self._params = [weakref.ref(p) for p in params]
        # id(parameter) -> its index, trained parameters only.
        self._indices = {id(params[i]): i for i in trained}

    def _access(self) -> States:
        states = self._states()
        if states is None:
            raise RuntimeError("the optimizer of this state view is gone")
        return states

    def _index(self, p: Any) -> int | None:
        i = self._indices.get(id(p))
        return i if i is not None and self._params[i]() is p else None

    def __getitem__(self, p: Any) -> dict[str, torch.Tensor]:
        i = self._index(p)
        if i is None:
            raise KeyError("not a trained parameter of this optimizer")
        return self._access().read([i], "optimizer.state")[i]

    def __contains__(self, p: Any) -> bool:
        self._access()
        return self._index(p) is not None

    def __iter__(self) -> Iterator[torch.Tensor]:
        self._access()
        return iter([self._params[i]() for i in sorted(self._indices.values())])

    def __len__(self) -> int:
        self._access()
        return len(self._indices)

    def items(self) -> ItemsView:
        """Every parameter's states in one engine read per kind (Lightning iterates them)."""
        indices = sorted(self._indices.values())
        read = self._access().read(indices, "optimizer.state")
        return {self._params[i](): read[i] for i in indices}.items()

    def values(self) -> ValuesView:
        return dict(self.items()).values()
