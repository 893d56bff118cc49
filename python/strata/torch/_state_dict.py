"""state_dict() and load_state_dict() of OffloadOptimizer in torch.optim's format: per
parameter index its ``step`` and moments, named as the matching torch optimizer names them (so
either loads into the other), plus ``master`` (the fp32 master value) when the parameters are
not fp32. The engine's states are read and written in one batch each."""

from __future__ import annotations

import weakref
from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from strata.torch.optimizer import OffloadOptimizer

# The engine's parameter states (ParameterState): the fp32 master and the two moments.
MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2


def pack(opt: OffloadOptimizer, whole: bool = False) -> dict[str, Any]:
    """The state_dict, between steps. Every trained parameter has its states, from
    construction on (zero moments at step 0, which torch AdamW's first step starts from too):
    torch.distributed.checkpoint loads only what the target's state_dict lists. `whole`:
    gathered from every rank's parts where the layout slices them (a collective)."""
    state = states(opt, opt._trained_indices, whole)
    groups = []
    first = 0
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(range(first, first + len(g["params"])))
        first += len(g["params"])
        groups.append(packed)
    return {"state": state, "param_groups": groups}


def states(opt: OffloadOptimizer, indices: list[int],
           whole: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    """Parameter index -> its step and states (named as torch names them), one engine read
    per kind; as the layout gives them (_sharded.py: whole, DTensors under FSDP2, this rank's
    slices with shard_states unless `whole`, which gathers them: a collective)."""
    names = dict(opt._state_names)
    if opt._params[0].dtype != torch.float32:
        names[MASTER] = "master"
    steps = torch.tensor(float(opt._engine.step_count))
    out: dict[int, dict[str, torch.Tensor]] = {i: {"step": steps.clone()} for i in indices}
    for kind in sorted(names):
        read = opt._read_states([(i, kind) for i in indices])
        shaped = (opt._layout.whole_states(indices, read) if whole
                  else opt._layout.states(indices, read))
        for i, state in zip(indices, shaped):
            out[i][names[kind]] = state
    return out


class StateView(Mapping):
    """``optimizer.state`` as torch code reads it (torch.distributed.checkpoint's
    get_state_dict, Lightning moving states to a device): each trained parameter -> its step
    and states, read from the engine at each access, as this rank holds them (with
    shard_states, its slices: reading never takes a collective). Copies: writing to them
    changes nothing (load_state_dict writes). Non-empty from construction on, so get_state_dict does not take
    the optimizer for a fresh torch one and run a step with zero gradients to create states."""

    def __init__(self, opt: OffloadOptimizer) -> None:
        self._opt = weakref.ref(opt)  # The optimizer holds its view: no cycle to delay close.
        # id(parameter) -> its index, trained parameters only.
        self._indices = {id(opt._params[i]): i for i in opt._trained_indices}

    def _optimizer(self) -> OffloadOptimizer:
        opt = self._opt()
        if opt is None:
            raise RuntimeError("the optimizer of this state view is gone")
        return opt

    def _index(self, p: Any) -> int | None:
        i = self._indices.get(id(p))
        return i if i is not None and self._optimizer()._params[i] is p else None

    def __getitem__(self, p: Any) -> dict[str, torch.Tensor]:
        i = self._index(p)
        if i is None:
            raise KeyError("not a trained parameter of this optimizer")
        return self._optimizer()._states_of([i])[i]

    def __contains__(self, p: Any) -> bool:
        return self._index(p) is not None

    def __iter__(self) -> Iterator[torch.Tensor]:
        opt = self._optimizer()
        return iter([p for p, trained in zip(opt._params, opt._trained) if trained])

    def __len__(self) -> int:
        return len(self._indices)

    def items(self) -> ItemsView:
        """Every parameter's states in one engine read per kind (Lightning iterates them)."""
        opt = self._optimizer()
        indices = sorted(self._indices.values())
        read = opt._states_of(indices)
        return {opt._params[i]: read[i] for i in indices}.items()

    def values(self) -> ValuesView:
        return dict(self.items()).values()


def unpack(opt: OffloadOptimizer, state_dict: dict[str, Any]) -> None:
    """Loads `state_dict`, between steps; every entry is checked before anything is written."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"the state_dict has {len(saved_groups)} parameter groups; this optimizer has "
            f"{len(opt.param_groups)}"
        )
    for gi, (mine, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if len(saved["params"]) != len(mine["params"]):
            raise ValueError(
                f"parameter group {gi} of the state_dict has {len(saved['params'])} "
                f"parameters; this optimizer's has {len(mine['params'])}"
            )
        for flag in ("amsgrad", "maximize"):
            if saved.get(flag, False):
                raise NotImplementedError(
                    f"parameter group {gi} of the state_dict has {flag}=True, which "
                    f"{type(opt).__name__} does not build"
                )
        fixed = opt._fixed_hyperparameters(saved)
        if fixed != opt._fixed[gi]:
            raise ValueError(
                f"parameter group {gi} of the state_dict has {fixed}, this optimizer "
                f"{opt._fixed[gi]}: the engine fixes these at construction, so build "
                f"{type(opt).__name__} with the saved values"
            )
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
    steps = 0
    writes = []
    for i, p in enumerate(opt._params):
        if not opt._trained[i]:
            continue
        entry = saved_state.get(i, {})
        for kind, name in [(MASTER, "master"), *opt._state_names.items()]:
            if name in entry:
                writes.append((i, kind, entry[name], name))
            elif kind != MASTER:
                writes.append((i, kind, torch.zeros(opt._layout.state_numel(i)), name))
        if "step" in entry:
            steps = max(steps, int(float(entry["step"])))
    # Every entry is checked before anything is written; then the values the model loaded
    # become the masters, then the saved states go in. Every parameter is compared, not only
    # those whose version counter moved: torch.distributed.checkpoint's load writes into the
    # parameters without moving it.
    batch = opt._state_batch(writes)
    opt._adopt_parameter_changes(everything=True)
    opt._write_state_batch(batch)
    with opt._on_device():
        opt._engine.set_step_count(steps)
    for mine, saved in zip(opt.param_groups, saved_groups):
        for key, value in saved.items():
            if key != "params":
                mine[key] = value
    opt._param_versions = opt._versions()
