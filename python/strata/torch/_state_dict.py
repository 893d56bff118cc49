"""state_dict() and load_state_dict() of OffloadOptimizer in torch.optim's format: per
parameter index its ``step`` and moments, named as the matching torch optimizer names them (so
either loads into the other), plus ``master`` (the fp32 master value) when the parameters are
not fp32. The engine's states are read and written in one batch each."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from strata.torch import _sharded

if TYPE_CHECKING:
    from strata.torch.optimizer import OffloadOptimizer

# The engine's parameter states (ParameterState): the fp32 master and the two moments.
MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2


def pack(opt: OffloadOptimizer) -> dict[str, Any]:
    """The state_dict, between steps."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    steps = opt._engine.step_count
    if steps > 0:
        names = dict(opt._state_names)
        if opt._params[0].dtype != torch.float32:
            names[MASTER] = "master"
        wanted = [(i, kind) for i in range(len(opt._params)) if opt._trained[i]
                  for kind in sorted(names)]
        for (i, kind), values in zip(wanted, opt._read_states(wanted)):
            entry = state.setdefault(i, {"step": torch.tensor(float(steps))})
            # Sharded: a DTensor of the parameter's sharding, as torch AdamW keeps under FSDP2.
            entry[names[kind]] = _sharded.as_parameter_state(values, opt._params[i])
    groups = []
    first = 0
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(range(first, first + len(g["params"])))
        first += len(g["params"])
        groups.append(packed)
    return {"state": state, "param_groups": groups}


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
                writes.append((i, kind, torch.zeros(_sharded.local(p).numel()), name))
        if "step" in entry:
            steps = max(steps, int(float(entry["step"])))
    # Every entry is checked before anything is written; then values the model loaded in
    # place become the masters, then the saved states go in.
    batch = opt._state_batch(writes)
    opt._adopt_parameter_changes()
    opt._write_state_batch(batch)
    with opt._on_device():
        opt._engine.set_step_count(steps)
    for mine, saved in zip(opt.param_groups, saved_groups):
        for key, value in saved.items():
            if key != "params":
                mine[key] = value
    opt._param_versions = opt._versions()
