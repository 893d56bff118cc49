"""The parameter groups' hyper-parameters as the engine holds them: betas, eps and each group's
weight decay fixed at construction, and one learning rate scaled per group by a fixed factor.
Any torch.optim.lr_scheduler works as long as the groups keep the ratios of their learning
rates (every built-in scheduler does, except per-group lambdas and a nonzero eta_min); a change
the engine cannot follow raises instead of being ignored."""

from __future__ import annotations

import math
from typing import Any

# Tolerance for "the same learning-rate ratio": schedulers compute each group's lr in floating
# point, so the ratios of two groups drift in the last bits.
_LR_RATIO_TOLERANCE = 1e-9


def fixed_hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """What the engine fixes at construction, per group."""
    fixed = {"weight_decay": float(group.get("weight_decay", 0.0))}
    if "betas" in group:
        fixed["betas"] = tuple(float(b) for b in group["betas"])
    if "eps" in group:
        fixed["eps"] = float(group["eps"])
    return fixed


class GroupSettings:
    """The groups' settings the engine was built with, and the checks of later changes."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self._groups = groups  # The optimizer's param_groups (the list itself).
        self.fixed = [fixed_hyperparameters(g) for g in groups]
        self.lr_scales = self._learning_rate_scales()

    def rebind(self, groups: list[dict[str, Any]]) -> None:
        """The optimizer's param_groups became `groups` (a wrapper set the attribute): they
        must hold the parameters of the groups before, which are the engine's, in the same
        groups; their fixed settings are checked at the next step as any change is."""
        def members(gs: list[dict[str, Any]]) -> list[list[int]]:
            return [[id(p) for p in g["params"]] for g in gs]
        if not isinstance(groups, list) or not all(
                isinstance(g, dict) and "params" in g for g in groups):
            raise ValueError("param_groups must be a list of dicts with 'params'")
        if members(groups) != members(self._groups):
            raise ValueError(
                f"param_groups replaced by groups of {[len(g['params']) for g in groups]} "
                "parameters that are not the parameters it was built with (in the same groups, "
                f"{[len(g['params']) for g in self._groups]}): the engine packs its parameters "
                "at construction; build a new optimizer for other parameters")
        self._groups = groups

    def largest_lr(self) -> float:
        return max(float(g["lr"]) for g in self._groups)

    def check_unchanged(self, gi: int) -> None:
        """Raises when group gi's fixed settings changed since construction."""
        now = fixed_hyperparameters(self._groups[gi])
        if now != self.fixed[gi]:
            raise NotImplementedError(
                f"parameter group {gi} changed to {now} from {self.fixed[gi]}; the engine fixes "
                "betas, eps and weight_decay at construction (OneCycleLR: pass "
                "cycle_momentum=False)")

    def check_saved(self, gi: int, saved: dict[str, Any], owner: str) -> None:
        """Raises when a state_dict's group gi has other fixed settings than `owner`'s."""
        fixed = fixed_hyperparameters(saved)
        if fixed != self.fixed[gi]:
            raise ValueError(
                f"parameter group {gi} of the state_dict has {fixed}, this optimizer "
                f"{self.fixed[gi]}: the engine fixes these at construction, so build "
                f"{owner} with the saved values")

    def base_learning_rate(self) -> float:
        """The engine's learning rate for the groups as they are now (a scheduler's), after
        checking that nothing fixed changed."""
        for gi in range(len(self._groups)):
            self.check_unchanged(gi)
        bases = [float(g["lr"]) / s for g, s in zip(self._groups, self.lr_scales)]
        base = max(bases)
        for gi, b in enumerate(bases):
            if abs(b - base) > _LR_RATIO_TOLERANCE * max(abs(base), 1e-300):
                lrs = [float(g["lr"]) for g in self._groups]
                raise NotImplementedError(
                    f"the parameter groups' learning rates {lrs} no longer keep the ratios "
                    f"{self.lr_scales} they had at construction (group {gi}); the engine "
                    "scales one learning rate per group by a fixed factor")
        return base

    def _learning_rate_scales(self) -> list[float]:
        """Each group's lr relative to the largest (the engine's base lr times this)."""
        groups = self._groups
        lrs = [float(g["lr"]) for g in groups]
        for gi, g in enumerate(groups):
            if lrs[gi] < 0 or not math.isfinite(lrs[gi]):
                raise ValueError(f"parameter group {gi}: lr must be finite and >= 0, got {g['lr']}")
            for key in ("betas", "eps"):
                if key in g and g[key] != groups[0][key]:
                    raise NotImplementedError(
                        f"parameter group {gi} has {key}={g[key]} but group 0 has "
                        f"{groups[0][key]}: the engine uses one {key} for all groups")
        largest = max(lrs)
        if largest == 0.0:
            return [1.0] * len(lrs)
        for gi, lr in enumerate(lrs):
            if lr == 0.0:
                raise ValueError(
                    f"parameter group {gi} has lr 0 while others do not; freeze its parameters "
                    "(requires_grad=False) instead")
        return [lr / largest for lr in lrs]
