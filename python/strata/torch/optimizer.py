"""OffloadOptimizer: a torch.optim.Optimizer backed by Strata's offload engine.

This class is the facade: it builds the parts and answers what torch.optim.Optimizer defines
(param_groups, state, step, zero_grad, state_dict, load_state_dict) plus Strata's extras. The
work is done by the parts, each in a file of its own:

- _params.py: one record per parameter (its group, chunk, views);
- _native.py: the engine handle, the only code that calls the C++ module;
- _layouts.py / _layout.py: how the parameters sit beside the engine's chunks (resident,
  mirrored FSDP2 shards or state slices, offloaded), each layout implementing one protocol;
- _step.py: the one step body every layout shares, and _step_state.py, a step's facts;
- _hyper.py: the groups' hyper-parameters as the engine fixes them;
- _state_dict.py: states in torch's format, through the layout;
- _lifetime.py: who owns a parameter's memory when the optimizer goes.

At construction every parameter is registered with the engine (in param_groups order, which
is also state_dict's numbering) and packed into chunks; the layout then makes the parameters
view (or mirror, or borrow) the chunks' memory and hooks them, so each chunk's update can
start during backward. ``step()`` hands over what is still waiting, waits for every update and
returns with the parameters updated in place: whatever the loop did to ``.grad`` between
backward and step(), the step is torch's, or it raises.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from strata.torch import _layouts, _lifetime
from strata.torch._hyper import GroupSettings
from strata.torch._native import NativeEngine
from strata.torch._options import auto_chunk_bytes, engine_options
from strata.torch._params import ParamTable
from strata.torch._state_dict import States, StateView
from strata.torch._step import StepBody


class OffloadOptimizer(torch.optim.Optimizer):
    """The common part of OffloadAdamW, OffloadAdam, OffloadAdagrad and OffloadLion.

    Subclasses name the engine's update rule and the state names of the torch optimizer they
    mirror (rules.py).
    """

    _engine_type: str = ""
    # state_dict key of each engine state (master, exp_avg, exp_avg_sq) the rule keeps.
    _state_names: dict[int, str] = {}
    # torch.amp.GradScaler hands a step-supporting optimizer its scale instead of unscaling the
    # gradients itself, which lets step() refuse it with a clear message (see step()).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        offload: str | None = "cpu",
        nvme_path: Any = None,
        offload_ratio: float = 1.0,
        max_grad_norm: float = 0.0,
        gradient_accumulation_steps: int | str = "auto",
        chunk_size: int | str = "auto",
        host_memory: int | str | None = None,
        cpu_threads: int = 0,
        loss_scale: float | str = "dynamic",
        speculative_updates: bool | None = None,
        overlap: bool = True,
        shard_states: bool = False,
        config: dict[str, Any] | None = None,
    ) -> None:
        if gradient_accumulation_steps != "auto" and (
                not isinstance(gradient_accumulation_steps, int)
                or isinstance(gradient_accumulation_steps, bool)
                or gradient_accumulation_steps < 1):
            raise ValueError(
                f"gradient_accumulation_steps must be 'auto' or an integer >= 1, got "
                f"{gradient_accumulation_steps!r}")
        if max_grad_norm is None or max_grad_norm < 0 or not math.isfinite(max_grad_norm):
            raise ValueError(
                f"max_grad_norm must be finite and >= 0 (0 = off), got {max_grad_norm!r}")
        max_grad_norm = float(max_grad_norm)
        self._constructed = False
        super().__init__(params, defaults)
        self._fixed = {"gradient_accumulation_steps": gradient_accumulation_steps,
                       "max_grad_norm": max_grad_norm, "overlap": overlap}
        owner = type(self).__name__

        table = ParamTable(self.param_groups)
        layout = _layouts.choose(table.params, shard_states=shard_states,
                                 gradient_accumulation_steps=gradient_accumulation_steps,
                                 overlap=overlap, max_grad_norm=max_grad_norm)
        # Rechecking, torch.amp.GradScaler unscales the gradients itself (an edit like any
        # other) and skips step() on overflow.
        self._step_supports_amp_scaling = not layout.rechecks
        settings = GroupSettings(self.param_groups)
        if chunk_size == "auto":
            chunk_size = auto_chunk_bytes(sum(layout.local(i, p).numel() * p.element_size()
                                              for i, p in enumerate(table.params)))
        options = engine_options(
            owner, self.param_groups[0], settings.largest_lr(), self._engine_type,
            float(self.defaults.get("weight_decay", 0.0)),
            device=table.device, dtype=table.dtype, offload=offload, nvme_path=nvme_path,
            offload_ratio=offload_ratio, chunk_size=chunk_size, host_memory=host_memory,
            cpu_threads=cpu_threads, loss_scale=loss_scale,
            speculative_updates=speculative_updates,
            max_grad_norm=max_grad_norm if layout.engine_clips else 0.0, config=config)
        layout.configure(options)
        # A live optimizer on these parameters gives them up to this one (`opt = ...` again),
        # before their values are read: offloaded ones get theirs back only then.
        for previous in _lifetime.owners(table.params):
            previous._body.close(f"its parameters were taken over by a new {owner}")
        registered = []
        for r, p in zip(table.records, table.params):
            group = self.param_groups[r.group]
            registered.append((f"param.{r.index}", layout.engine_shape(r.index),
                               layout.registered_values(r.index).numpy(),
                               float(group["weight_decay"]), settings.lr_scales[r.group],
                               not p.requires_grad))
        native = NativeEngine(options, registered, table.device,
                              fit_host_device=layout.fits_host_device)
        table.locate(native.location, native.chunk_count)
        self._table, self._native = table, native
        self._body = StepBody(owner, native, table, layout, settings, list(self._state_names))
        detach = layout.attach(native, table, self._body)
        self._body.finalizer = weakref.finalize(self, *detach)
        _lifetime.claim(self, table.params)
        self._states = States(self._body, self._state_names)
        # torch's per-parameter state, read from the engine (torch.optim's own dict is unused).
        self.state = StateView(self._states, table.params, table.trained)
        # shard_states: the whole states consolidate_state_dict() gathered, until the next step.
        self._consolidated: dict[str, Any] | None = None
        self._constructed = True

    # ----------------------------------------------------------------- torch.optim interface

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        """torch.optim's attribute, which wrappers (accelerate's AcceleratedOptimizer) set: once
        built, the new list must hold the same parameters in the same groups, and it is the one
        the engine reads the learning rate from (a scheduler changes it) from then on."""
        if getattr(self, "_constructed", False):
            self._body.settings.rebind(groups)
        self._param_groups = groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_constructed", False):
            raise NotImplementedError(
                f"{type(self).__name__} packs every parameter into the engine's chunks at "
                "construction: pass every parameter group to the constructor")
        seen = set()
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} appears twice in one parameter "
                    "group; register each parameter once")
            seen.add(id(p))
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad. After a backward whose gradients no chunk has taken yet, it also
        discards that backward (a skipped batch); once chunks were handed to the engine the step
        can only be finished, by step(), unless the engine can take them back (CPU tensors)."""
        if self._body.zero_grad():
            super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Waits for the updates of this step (most ran during backward) and returns the
        closure's loss, if a closure was given."""
        body = self._body
        body.check_open("step()", closure_given=closure is not None)
        scale = getattr(self, "grad_scale", None)
        if scale is not None or getattr(self, "found_inf", None) is not None:
            self.grad_scale = self.found_inf = None
            body.refuse_grad_scaler(
                scale, lambda: torch.optim.Optimizer.zero_grad(self, set_to_none=True))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Gathered before this step: stale once it changes the states, even if step() raises
        # after the engine's step completed.
        self._consolidated = None
        error = body.step()
        if error:
            raise RuntimeError(error)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format: per parameter index its ``step`` and moments (named as the
        matching torch optimizer names them; loadable into it), plus ``master`` (the fp32 master
        value) when the parameters are not fp32."""
        if self._body.layout.consolidates:
            self._body.check_between_steps("state_dict()")
            if self._consolidated is None:
                raise RuntimeError(
                    "state_dict() with shard_states=True: each rank holds 1/N of the states, so "
                    "call opt.consolidate_state_dict(to=0) on every rank first (a collective), "
                    "then state_dict() on rank 0, as with torch's ZeroRedundancyOptimizer; "
                    "its consolidation lasts until the next step")
            return self._consolidated
        return self._states.pack(self.param_groups, "state_dict()")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this optimizer or of the matching torch optimizer (AdamW's into
        OffloadAdamW, say): hyper-parameters, moments and the step count; a parameter without
        saved state starts afresh, as in torch. The parameters' values come from the model
        (``model.load_state_dict``), or from ``master`` when present."""
        self._body.check_between_steps("load_state_dict()")
        self._consolidated = None  # Gathered before this load: stale.
        self._states.unpack(self.param_groups, state_dict)

    # ------------------------------------------------------------------------- extras

    # Settings the engine and the layout are built with. They cannot change later, so a
    # change raises instead of being ignored.
    def _fixed_setting(name: str, doc: str) -> property:  # noqa: N805 (a class-body helper)
        def get(self: OffloadOptimizer) -> Any:
            return self._fixed[name]

        def refuse(self: OffloadOptimizer, value: Any) -> None:
            raise AttributeError(
                f"{name} is fixed at construction ({type(self).__name__} was built with "
                f"{name}={self._fixed[name]!r}): the engine and the gradient hooks are laid out "
                f"for it; build a new optimizer with {name}={value!r}")
        return property(get, refuse, doc=doc)

    max_grad_norm = _fixed_setting(
        "max_grad_norm", "The global gradient norm the step clips to (0: no clipping).")
    gradient_accumulation_steps = _fixed_setting(
        "gradient_accumulation_steps", "Backward passes per step, or 'auto'.")
    overlap = _fixed_setting(
        "overlap", "Whether chunks are updated during backward, as their gradients complete.")
    del _fixed_setting

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """shard_states=True: gathers every rank's slices of the states so that state_dict() on
        rank `to` (every rank with None) returns them whole, in torch AdamW's format, until the
        next step. A collective: every rank calls it. Without shard_states, nothing to do."""
        self._body.check_between_steps("consolidate_state_dict()")
        if not self._body.layout.consolidates:
            return
        packed = self._states.pack(self.param_groups, "consolidate_state_dict()", whole=True)
        self._consolidated = packed if to is None or to == dist.get_rank() else None

    def close(self) -> None:
        """Stops driving the parameters: they get memory of their own holding their current
        values, the optimizer's hooks go, and every later call on it raises. Call it before
        training the same parameters with another optimizer that is not a strata one (a new
        strata optimizer takes them over by itself); an LR scheduler or a framework that keeps
        this optimizer alive then no longer matters. Calling it again does nothing. Mid-step,
        the open step is dropped first (CPU tensors; on a GPU, once a chunk was handed over,
        call step() first: an update in flight would race with the copy the parameters get)."""
        self._body.close_by_request()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward() on: multiplied by the fp16 loss scale (unchanged in
        fp32 and bf16). The engine divides the gradients by the same scale."""
        scale = self._native.loss_scale
        return loss if scale == 1.0 else loss * scale

    @property
    def loss_scale(self) -> float:
        return self._native.loss_scale

    @property
    def last_step(self) -> dict[str, Any] | None:
        """The last step's report: step, iteration, skipped (fp16 overflow), rolled_back,
        changed_chunks (chunks whose gradients changed after they were handed over, by
        clipping or unscaling, say: their updates were redone from the gradients at step()),
        grad_norm (before clipping), loss_scale, seconds."""
        return self._body.last_report

    def sync_parameters(self) -> None:
        """Makes the parameters' current values the masters, whatever wrote them. Writes to a
        parameter itself (``model.load_state_dict``, in-place ops under ``no_grad``) are found at
        the next backward without this; writes through ``.data`` bypass the version counter
        that finds them, so call this after those (WGAN's ``p.data.clamp_``, say)."""
        self._body.check_between_steps("sync_parameters()")
        self._body.layout.adopt_parameter_changes(everything=True)

    def metrics(self) -> dict[str, Any]:
        """The engine's counters (bytes moved per tier, optimizer time, tier use) and the
        last step's report, as one flat dict."""
        native, body = self._native, self._body
        out = native.counters()
        out["steps"] = native.step_count
        out["iterations"] = native.iteration_count
        out["skipped_steps"] = body.skipped_steps
        out["loss_scale"] = native.loss_scale
        body.layout.metrics(out)
        if body.last_report is not None:
            out["grad_norm"] = body.last_report["grad_norm"]
            out["step_seconds"] = body.last_report["seconds"]
        return out

    def metrics_text(self) -> str:
        """The engine's metrics in Prometheus' text format (what `strata serve` exposes)."""
        return self._native.metrics_text()
