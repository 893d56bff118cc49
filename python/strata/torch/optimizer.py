"""OffloadOptimizer: a torch.optim.Optimizer backed by Strata's offload engine.

How it works, in the terms of engine.h's trainer contract:

* At construction every parameter is registered with the engine (in param_groups order, which
  is also state_dict's numbering) and packed into chunks. Each parameter's ``.data`` then becomes
  a view into its chunk's device memory (as FSDP's FlatParameter does), which stays put for the
  engine's life: the model, its hooks and ``model.state_dict()`` keep working on the same
  ``Parameter`` objects. When the optimizer goes, they get memory of their own (_lifetime.py).
  Across ranks the engine may hold only a part of each parameter (_sharded.py: an FSDP2 shard,
  or a 1/N slice with ``shard_states``); such parts are mirrored instead: copied into the chunk
  with their gradients, and back (all-gathered, for slices) after the step.
* A post-accumulate-grad hook on every trained parameter counts backward passes. On the last
  micro-step of a step (``gradient_accumulation_steps``, or with "auto" the most backward passes
  a step has had so far; the first step, which has no such count yet, hands everything over in
  step()), the parameter's gradient is placed in its chunk's gradient buffer (``.grad`` becomes
  a view of it; when autograd already accumulated into that view nothing is copied), and once
  every parameter of a chunk has its gradient the chunk is handed to the engine, whose CPU
  update starts while backward goes on. What a step has gathered so far is its StepState
  (_step_state.py); state_dict translation is _state_dict.py's.
* ``step()`` hands over the chunks still waiting, waits for every update, and returns with the
  parameters updated in place.
* An update made during backward (speculative_updates; by default beside a GPU only, see
  _options.speculates_by_default) is speculative: on CPU tensors the engine reads every chunk's
  gradients again at ``step()`` (optimizer.recheck_gradients, a checksum taken as it first
  measured them), and a chunk whose gradients the trainer changed meanwhile
  (``clip_grad_norm_`` that clips, ``GradScaler``'s unscale, an edit through ``.data``, a
  replaced ``.grad``) is rolled back and updated again from them. Multiplying by exactly 1 (a
  clip that does not clip) changes nothing, so the updates made ahead stand. On a GPU that
  recheck is not built yet, and a change the version counters see raises instead.

A step's life: closed -> open (first gradient hook: torch-side changes reach the engine) ->
chunks handed over -> closed by step(). zero_grad() before step() discards the step as torch
would, and so does a backward that follows a handed-over one without step() (a longer
accumulation window, a skipped GradScaler step): the engine drops what it did for it
(_take_back). On a GPU, once a chunk is handed over the step can only be finished. A failed
engine step keeps the step open and the next step() retries it.

Hyper-parameters: the engine fixes betas, eps and each group's weight decay at construction;
the learning rate is read from ``param_groups`` at the first backward of every step, so any
``torch.optim.lr_scheduler`` works as long as the groups keep the ratios of their learning rates
(every built-in scheduler does, except per-group lambdas and a nonzero ``eta_min``); a change the
engine cannot follow raises instead of being ignored.
"""

from __future__ import annotations

import contextlib
import json
import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from strata import _strata
from strata.torch import _device, _lifetime, _param_offload, _sharded, _state_dict
from strata.torch._options import (WORKING_DTYPES, auto_chunk_bytes, engine_options,
                                   rechecks_gradients)
from strata.torch._state_dict import MASTER
from strata.torch._step_state import StepState

# Tolerance for "the same learning-rate ratio": schedulers compute each group's lr in floating
# point, so the ratios of two groups drift in the last bits.
_LR_RATIO_TOLERANCE = 1e-9


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
                f"{gradient_accumulation_steps!r}"
            )
        if max_grad_norm is None or max_grad_norm < 0 or not math.isfinite(max_grad_norm):
            raise ValueError(
                f"max_grad_norm must be finite and >= 0 (0 = off), got {max_grad_norm!r}")
        self._constructed = False
        super().__init__(params, defaults)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        # The backward passes after which a chunk's gradients are complete, so that it can be
        # handed to the engine during backward: the count given, or with "auto" the most a
        # step has had (None before the first step). A framework that accumulates (the HF
        # Trainer's gradient_accumulation_steps, Lightning's accumulate_grad_batches) then
        # needs no second declaration, and a shorter window (an epoch's last batches) hands
        # everything over in step(), after its last backward.
        self._rhythm: int | None = (None if gradient_accumulation_steps == "auto"
                                    else gradient_accumulation_steps)
        self.max_grad_norm = float(max_grad_norm)
        # False: every chunk goes to the engine in step(), after backward (to measure what the
        # overlap saves, or to be able to discard any backward with zero_grad()).
        self.overlap = overlap

        self._params: list[torch.nn.Parameter] = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._check_parameters()
        self._device = self._params[0].device
        # Which part of each parameter this rank's engine holds (_sharded.py): all of it, its
        # FSDP2 shard, or with shard_states its 1/N slice.
        self._layout = _sharded.layout(self._params, shard_states)
        # offload_parameters(model) was called: the parameters live off the device between
        # uses, and a ParameterResidency puts them there while their modules run.
        self._plan = _param_offload.plan_of(self._params)
        if self._plan is not None and (self._layout.mirrors or (
                dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)):
            raise NotImplementedError(
                "offload_parameters across several ranks (FSDP2, DDP, shard_states) is not "
                "built yet: offloaded parameters work on one rank")
        # The engine reads the gradients again at step() and redoes what changed (CPU tensors,
        # _options.rechecks_gradients): whatever the trainer did to them between backward and
        # step(), the step uses them as they are then. torch.amp.GradScaler then unscales the
        # gradients itself (an edit like any other) and skips step() on overflow.
        self._rechecks = rechecks_gradients(self._device) and self._plan is None
        self._step_supports_amp_scaling = not self._rechecks
        self._trained = [p.requires_grad for p in self._params]
        self._trained_indices = [i for i, t in enumerate(self._trained) if t]
        self._fixed = [self._fixed_hyperparameters(g) for g in self.param_groups]
        self._lr_scales = self._learning_rate_scales()
        self._closed: str | None = None  # Why this optimizer no longer drives its parameters.

        if chunk_size == "auto":
            chunk_size = auto_chunk_bytes(sum(self._layout.local(i, p).numel() * p.element_size()
                                              for i, p in enumerate(self._params)))
        options = engine_options(
            type(self).__name__, self.param_groups[0],
            max(float(g["lr"]) for g in self.param_groups),
            self._engine_type, float(self.defaults.get("weight_decay", 0.0)),
            device=self._device, dtype=self._params[0].dtype, offload=offload,
            nvme_path=nvme_path, offload_ratio=offload_ratio, chunk_size=chunk_size,
            host_memory=host_memory, cpu_threads=cpu_threads, loss_scale=loss_scale,
            speculative_updates=speculative_updates,
            # Mirrored, the engine sees one rank's part: step() clips on the whole norm.
            max_grad_norm=0.0 if self._layout.mirrors else self.max_grad_norm,
            config=config)
        if self._plan is not None:
            _param_offload.place(options, self._plan, self._engine_accumulation())
        # A live optimizer on these parameters gives them up to this one (`opt = ...` again),
        # before their values are read: offloaded ones get theirs back only then.
        for previous in _lifetime.owners(self._params):
            previous._close(f"its parameters were taken over by a new {type(self).__name__}")
        registered = []
        for i, p in enumerate(self._params):
            group = self.param_groups[self._group_of[i]]
            registered.append((f"param.{i}", self._layout.engine_shape(i),
                               _flat_fp32(self._layout.local(i, p)).numpy(),
                               float(group["weight_decay"]),
                               self._lr_scales[self._group_of[i]], not p.requires_grad))
        with self._on_device():
            self._engine = _strata.Engine(
                json.dumps(options), registered,
                fit_host_device=self._plan is None or self._plan.device_memory is None)

        # Every chunk's memory, once: device-home chunks keep it for the engine's life.
        self._chunk_params: list[torch.Tensor] = []
        self._chunk_grads: list[torch.Tensor | None] = []
        for c in range(self._engine.chunk_count if self._plan is None else 0):
            with self._on_device():
                params_view, grads_view = self._engine.acquire(c)
                self._engine.release(c)
            self._chunk_params.append(torch.from_dlpack(params_view))
            self._chunk_grads.append(None if grads_view is None else torch.from_dlpack(grads_view))

        self._chunk_of: list[int] = []
        # Elements each parameter has in its chunk: its local part's, or 1 for an empty shard.
        self._engine_numel: list[int] = []
        # Each parameter's place in its chunk, shaped as the parameter (as its local shard,
        # sharded): what .data (and .grad) view. Fixed for the engine's life (device-home chunks
        # do not move).
        self._param_views: list[torch.Tensor] = []
        self._grad_views: list[torch.Tensor | None] = []
        self._members: list[list[int]] = [[] for _ in range(self._engine.chunk_count)]
        hooks = []
        for i, p in enumerate(self._params):
            chunk, offset, numel = self._engine.location(i)
            self._chunk_of.append(chunk)
            self._engine_numel.append(numel)
            if self._plan is not None:
                if p.requires_grad:
                    self._members[chunk].append(i)
                continue
            mine = self._layout.local(i, p)
            self._param_views.append(
                self._chunk_params[chunk][offset : offset + mine.numel()].view(mine.shape))
            if not self._layout.mirrors:  # Mirrored, the chunk copies the parameter's part.
                p.data = self._param_views[i]
            if p.requires_grad:
                self._grad_views.append(
                    self._chunk_grads[chunk][offset : offset + mine.numel()].view(mine.shape))
                self._members[chunk].append(i)
                hooks.append(p.register_post_accumulate_grad_hook(_GradHook(self, i)))
            else:
                self._grad_views.append(None)
        self._residency: _param_offload.ParameterResidency | None = None
        if self._plan is not None:
            self._residency = _param_offload.ParameterResidency(self, self._plan)
            self._finalizer = weakref.finalize(self, self._residency.remove)
        else:
            self._finalizer = _lifetime.watch(self, self._params, hooks,
                                              self._chunk_params + [g for g in self._chunk_grads
                                                                    if g is not None])
        _lifetime.claim(self, self._params)
        self._param_versions = self._versions()
        self._last_report: dict[str, Any] | None = None
        self._skipped_steps = 0
        self._retry_pending = False  # The engine's step failed; the next step() retries it.
        # States of parameters without gradients to put back after a step (see
        # _hand_over_the_rest), kept until written.
        self._restore_pending: list[tuple[int, int, torch.Tensor]] = []
        self._reset_step()
        # torch's per-parameter state, read from the engine (torch.optim's own dict is unused).
        self.state = _state_dict.StateView(self)
        # shard_states: the whole states consolidate_state_dict() gathered, until the next step.
        self._consolidated: dict[str, Any] | None = None
        self._constructed = True

    # ----------------------------------------------------------------- torch.optim interface

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_constructed", False):
            raise NotImplementedError(
                f"{type(self).__name__} packs every parameter into the engine's chunks at "
                "construction: pass every parameter group to the constructor"
            )
        seen = set()
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} appears twice in one parameter "
                    "group; register each parameter once"
                )
            seen.add(id(p))
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad. After a backward whose gradients no chunk has taken yet, it also
        discards that backward (a skipped batch); once chunks were handed to the engine the step
        can only be finished, by step()."""
        self._check_open("zero_grad()")
        if self._residency is not None:
            self._residency.after_interruption()
            handed = self._residency.handed_chunks()
            if handed and not self._retry_pending:
                raise RuntimeError(
                    f"zero_grad() after backward() without step(): with offload_parameters the "
                    f"gradients of chunks {handed} went to the engine during backward (they do "
                    "not stay on the device); call step() to finish the step")
            self._residency.clear_gradients()
            return
        if self._this_step.open:
            handed = self._this_step.handed()
            if handed and self._rechecks:
                self._take_back()
            elif handed:
                raise RuntimeError(
                    f"zero_grad() after backward() without step(): chunks {handed} already "
                    "started updating with those gradients (the update overlaps backward); call "
                    "step() to finish the step, or build the optimizer with overlap=False to be "
                    "able to discard a backward"
                )
            self._reset_step()
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Waits for the updates of this step (most ran during backward) and returns the
        closure's loss, if a closure was given."""
        self._check_open("step()", closure_given=closure is not None)
        self._refuse_grad_scaler()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._residency is not None:
            self._step_offloaded()
            return loss
        modified = None
        if not self._retry_pending:
            self._check_backward_count()
            if self._layout.mirrors:
                self._this_step.grad_norm = self._layout.grad_norm(self._trained_indices,
                                                                   self.max_grad_norm)
            if self._rechecks:
                self._sync_handed_gradients()
            else:
                modified = self._gradients_modified_after_backward()
            self._hand_over_the_rest()
            if not self._this_step.handed():
                # Every .grad was set to None after backward (model.zero_grad()): torch skips
                # every parameter, and so does this step.
                self._reset_step()
                return loss
        grad_norm = self._this_step.grad_norm

        def finished() -> None:
            self._restore_pending += self._this_step.untouched
            self._learn_rhythm()
            self._reset_step()
        report = self._engine_step(finished)
        self._restore_untouched()
        self._consolidated = None
        if self._layout.mirrors:
            self._publish_parts()
            report["grad_norm"] = grad_norm
        self._record(report)
        if modified:
            raise RuntimeError(
                f"the gradients of {modified} changed between backward() and step() (by "
                "torch.nn.utils.clip_grad_norm_, say) after the engine had taken them, so this "
                "step used them as they were before, after or during the change (the engine "
                "reads them where backward put them, as its updates run). Pass max_grad_norm=... "
                f"to {type(self).__name__} to clip on the global norm, and read the norm from "
                "opt.last_step['grad_norm'] instead of computing it"
            )
        return loss

    def _step_offloaded(self) -> None:
        """step() with offload_parameters: every chunk went to the engine during backward."""
        residency = self._residency
        if not self._retry_pending:
            if residency.backward_passes() == 0:
                residency.after_interruption()
                raise RuntimeError(
                    "step() before any backward(): no parameter received a gradient since the "
                    "last step()")
            residency.before_step()

        def finished() -> None:
            # Parameters without a gradient in this step (ParameterResidency._keep_untouched).
            self._restore_pending += self._this_step.untouched
            residency.step_done()
            self._reset_step()
        self._record(self._engine_step(finished))
        self._restore_untouched()

    def _engine_step(self, finished: Callable[[], None]) -> dict[str, Any]:
        """The engine's step; `finished` runs once it completed (a failed one waits for step()
        to retry it). Whether the engine finished is its iteration count's business, not the
        exception's: a Ctrl-C can arrive just after a successful call returns."""
        before = self._engine.iteration_count
        try:
            with self._on_device():
                return self._engine.step()
        finally:
            self._retry_pending = self._engine.iteration_count == before
            if not self._retry_pending:
                finished()

    def _record(self, report: dict[str, Any]) -> None:
        self._last_report = report
        if report["skipped"]:
            self._skipped_steps += 1

    def _engine_accumulation(self) -> int:
        """With offload_parameters the engine sums the micro-steps: their count ("auto" = 1,
        since it must be known before the first backward)."""
        gas = self.gradient_accumulation_steps
        return 1 if gas == "auto" else gas

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format: per parameter index its ``step`` and moments (named as the
        matching torch optimizer names them; loadable into it), plus ``master`` (the fp32 master
        value) when the parameters are not fp32."""
        self._check_open("state_dict()")
        self._check_between_steps("state_dict()")
        self._restore_untouched()
        if self._layout.consolidates:
            if self._consolidated is None:
                raise RuntimeError(
                    "state_dict() with shard_states=True: each rank holds 1/N of the states, so "
                    "call opt.consolidate_state_dict(to=0) on every rank first (a collective), "
                    "then state_dict() on rank 0, as with torch's ZeroRedundancyOptimizer; "
                    "its consolidation lasts until the next step")
            return self._consolidated
        return _state_dict.pack(self)

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """shard_states=True: gathers every rank's slices of the states so that state_dict() on
        rank `to` (every rank with None) returns them whole, in torch AdamW's format, until the
        next step. A collective: every rank calls it. Without shard_states, nothing to do."""
        self._check_open("consolidate_state_dict()")
        self._check_between_steps("consolidate_state_dict()")
        self._restore_untouched()
        if not self._layout.consolidates:
            return
        packed = _state_dict.pack(self, whole=True)
        self._consolidated = packed if to is None or to == dist.get_rank() else None

    def _states_of(self, indices: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        """``self.state[p]``'s read (_state_dict.StateView), checked as state_dict() is."""
        self._check_open("optimizer.state")
        self._check_between_steps("optimizer.state")
        self._restore_untouched()
        return _state_dict.states(self, indices)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this optimizer or of the matching torch optimizer (AdamW's into
        OffloadAdamW, say): hyper-parameters, moments and the step count; a parameter without
        saved state starts afresh, as in torch. The parameters' values come from the model
        (``model.load_state_dict``), or from ``master`` when present."""
        self._check_open("load_state_dict()")
        self._check_between_steps("load_state_dict()")
        self._restore_untouched()
        self._consolidated = None  # Gathered before this load: stale.
        _state_dict.unpack(self, state_dict)

    # ------------------------------------------------------------------------- extras

    def close(self) -> None:
        """Stops driving the parameters: they get memory of their own holding their current
        values, the optimizer's hooks go, and every later call on it raises. Call it before
        training the same parameters with another optimizer that is not a strata one (a new
        strata optimizer takes them over by itself); an LR scheduler or a framework that keeps
        this optimizer alive then no longer matters. Calling it again does nothing. Mid-step,
        the open step is dropped first (CPU tensors; on a GPU, once a chunk was handed over,
        call step() first: an update in flight would race with the copy the parameters get)."""
        if self._closed is not None:
            return
        if (self._residency is not None and self._residency.handed_chunks()
                and not self._retry_pending):
            raise RuntimeError(
                f"close() while chunks {self._residency.handed_chunks()} are updating with "
                "this step's gradients: call step() to finish the step first")
        if self._this_step.handed() and not self._retry_pending and self._rechecks:
            self._take_back()
        if self._this_step.handed() and not self._retry_pending:
            raise RuntimeError(
                f"close() while chunks {self._this_step.handed()} are "
                "updating with this step's gradients: call step() to finish the step first")
        self._close("close() was called")

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward() on: multiplied by the fp16 loss scale (unchanged in
        fp32 and bf16). The engine divides the gradients by the same scale."""
        scale = self._engine.loss_scale
        return loss if scale == 1.0 else loss * scale

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scale

    @property
    def last_step(self) -> dict[str, Any] | None:
        """The last step's report: step, iteration, skipped (fp16 overflow), rolled_back,
        changed_chunks (chunks whose gradients changed after they were handed over, by
        clipping or unscaling, say: their updates were redone from the gradients at step()),
        grad_norm (before clipping), loss_scale, seconds."""
        return self._last_report

    def sync_parameters(self) -> None:
        """Makes the parameters' current values the masters, whatever wrote them. Writes to a
        parameter itself (``model.load_state_dict``, in-place ops under ``no_grad``) are found at
        the next backward without this; writes through ``.data`` bypass the version counter
        that finds them, so call this after those (WGAN's ``p.data.clamp_``, say)."""
        self._check_open("sync_parameters()")
        self._check_between_steps("sync_parameters()")
        self._adopt_parameter_changes(everything=True)

    def metrics(self) -> dict[str, Any]:
        """The engine's counters (bytes moved per tier, optimizer time, tier use) and the
        last step's report, as one flat dict."""
        out = dict(self._engine.counters())
        out["steps"] = self._engine.step_count
        out["iterations"] = self._engine.iteration_count
        out["skipped_steps"] = self._skipped_steps
        out["loss_scale"] = self._engine.loss_scale
        if self._residency is not None:
            # Parameters filled for the modules running (torch's tensors, beside the engine's
            # device copies that device_peak_bytes counts).
            out["filled_param_bytes"] = self._residency.filled_bytes
            out["filled_param_peak_bytes"] = self._residency.peak_filled_bytes
        if self._last_report is not None:
            out["grad_norm"] = self._last_report["grad_norm"]
            out["step_seconds"] = self._last_report["seconds"]
        return out

    def metrics_text(self) -> str:
        """The engine's metrics in Prometheus' text format (what `strata serve` exposes)."""
        return self._engine.metrics_text()

    # ------------------------------------------------------------- construction checks

    def _check_parameters(self) -> None:
        first = self._params[0]
        for i, p in enumerate(self._params):
            name = f"parameter {i} (shape {tuple(p.shape)}, group {self._group_of[i]})"
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
            if _sharded.is_dtensor(p) != _sharded.is_dtensor(first):
                raise ValueError(
                    f"{name} is {'' if _sharded.is_dtensor(p) else 'not '}a DTensor but "
                    f"parameter 0 is {'' if _sharded.is_dtensor(first) else 'not'}: shard the "
                    "whole model with fully_shard (FSDP2), or none of it")

    def _fixed_hyperparameters(self, group: dict[str, Any]) -> dict[str, Any]:
        """What the engine fixes at construction, per group."""
        fixed = {"weight_decay": float(group.get("weight_decay", 0.0))}
        if "betas" in group:
            fixed["betas"] = tuple(float(b) for b in group["betas"])
        if "eps" in group:
            fixed["eps"] = float(group["eps"])
        return fixed

    def _learning_rate_scales(self) -> list[float]:
        """Each group's lr relative to the largest (the engine's base lr times this)."""
        lrs = [float(g["lr"]) for g in self.param_groups]
        for gi, g in enumerate(self.param_groups):
            if lrs[gi] < 0 or not math.isfinite(lrs[gi]):
                raise ValueError(f"parameter group {gi}: lr must be finite and >= 0, got {g['lr']}")
            for key in ("betas", "eps"):
                if key in g and g[key] != self.param_groups[0][key]:
                    raise NotImplementedError(
                        f"parameter group {gi} has {key}={g[key]} but group 0 has "
                        f"{self.param_groups[0][key]}: the engine uses one {key} for all groups"
                    )
        largest = max(lrs)
        if largest == 0.0:
            return [1.0] * len(lrs)
        for gi, lr in enumerate(lrs):
            if lr == 0.0:
                raise ValueError(
                    f"parameter group {gi} has lr 0 while others do not; freeze its parameters "
                    "(requires_grad=False) instead"
                )
        return [lr / largest for lr in lrs]

    # -------------------------------------------------------------------- a step's life

    def _reset_step(self) -> None:
        self._this_step = StepState(self._members, len(self._params))

    def _begin_step(self) -> None:
        """At the first gradient of a step: what torch-side code changed since the last step
        (parameters loaded in place, a scheduler's learning rate) reaches the engine."""
        self._check_open("backward()")
        self._restore_untouched()
        for i, p in enumerate(self._params):
            if p.requires_grad != self._trained[i]:
                now = "trainable" if p.requires_grad else "frozen"
                raise NotImplementedError(
                    f"parameter {i} (shape {tuple(p.shape)}) is {now} now but was not when "
                    f"{type(self).__name__} was built: the engine packs frozen and trained "
                    "parameters apart at construction, so changing requires_grad needs a new "
                    "optimizer (build it after freezing or unfreezing)"
                )
        for gi, g in enumerate(self.param_groups):
            if self._fixed_hyperparameters(g) != self._fixed[gi]:
                raise NotImplementedError(
                    f"parameter group {gi} changed to {self._fixed_hyperparameters(g)} from "
                    f"{self._fixed[gi]}; the engine fixes betas, eps and weight_decay at "
                    "construction (OneCycleLR: pass cycle_momentum=False)"
                )
        bases = [float(g["lr"]) / s for g, s in zip(self.param_groups, self._lr_scales)]
        base = max(bases)
        for gi, b in enumerate(bases):
            if abs(b - base) > _LR_RATIO_TOLERANCE * max(abs(base), 1e-300):
                lrs = [float(g["lr"]) for g in self.param_groups]
                raise NotImplementedError(
                    f"the parameter groups' learning rates {lrs} no longer keep the ratios "
                    f"{self._lr_scales} they had at construction (group {gi}); the engine "
                    "scales one learning rate per group by a fixed factor"
                )
        self._adopt_parameter_changes()
        self._engine.set_learning_rate(base)
        self._this_step.open = True

    def _on_gradient(self, i: int) -> None:
        """Parameter i's post-accumulate-grad hook: one more backward pass reached it. Checks
        come before any count changes, so an error leaves the step as it was."""
        p = self._params[i]
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients (parameter {i}, shape "
                f"{tuple(p.shape)}); use nn.Embedding(sparse=False)"
            )
        if self._retry_pending:
            self._check_open("backward()")
        if not self._this_step.open:
            self._begin_step()
        step = self._this_step
        gas = self.gradient_accumulation_steps
        chunk = self._chunk_of[i]
        if self._rechecks and (step.submitted[chunk] or
                               (step.placed[i] and not self._holds_placed_gradient(i))):
            # A backward after this chunk was handed over without step() between (a window
            # longer than any before, with "auto"), or after this parameter's placed gradient
            # was set to None or replaced (a step the loop skipped with model.zero_grad()): the
            # engine drops what it did, if anything, and gradients the loop discarded count
            # afresh; step() hands over again.
            if step.handed():
                self._take_back()
            self._restart_discarded_counts()
        if gas == "auto" and step.submitted[chunk]:
            raise RuntimeError(
                f"parameter {i} (shape {tuple(p.shape)}) received its gradient "
                f"{step.counts[i] + 1} times since the last step(), more than the "
                f"{self._rhythm} backward passes of any step before, and chunk {chunk}'s update "
                f"had already started with {self._rhythm} passes' gradients (the update "
                "overlaps backward), so this step's update of it is partial. With "
                "gradient_accumulation_steps='auto' the number of backward passes per step() may "
                "shrink but not grow: pass gradient_accumulation_steps=N (the most backward "
                "passes per step(); the HF Trainer's gradient_accumulation_steps, Lightning's "
                "accumulate_grad_batches) or overlap=False. " + self._hooks_hint()
            )
        if gas != "auto" and step.counts[i] + 1 > gas:
            raise RuntimeError(
                f"parameter {i} (shape {tuple(p.shape)}) received its gradient "
                f"{step.counts[i] + 1} times since the last step(), but this optimizer was "
                f"built with gradient_accumulation_steps={gas}: call step() after every {gas} "
                "backward(), one backward per micro-batch, or leave gradient_accumulation_steps "
                "at its default, 'auto', to follow the trainer's (the HF Trainer's "
                "gradient_accumulation_steps, Lightning's accumulate_grad_batches). "
                "torch.utils.checkpoint with use_reentrant=True runs a parameter's gradient hook "
                "twice: use use_reentrant=False. " + self._hooks_hint()
            )
        step.counts[i] += 1
        # A parameter past the rhythm ("auto", a longer window) was placed at the rhythm and
        # goes on accumulating in its chunk's buffer until the chunk is handed over.
        if step.counts[i] != self._rhythm or not self.overlap:
            return
        self._place_gradient(i)
        step.waiting[chunk] -= 1
        if step.waiting[chunk] == 0:
            self._submit(chunk)

    def _check_backward_count(self) -> None:
        most = max(self._this_step.counts, default=0)
        if most == 0:
            raise RuntimeError(
                "step() before any backward(): no parameter received a gradient since the last "
                "step()"
            )
        gas = self.gradient_accumulation_steps
        if gas != "auto" and most != gas:
            raise RuntimeError(
                f"step() after {most} backward passes, but this optimizer was built with "
                f"gradient_accumulation_steps={gas}: call step() after every {gas} backward(), "
                "or zero_grad() to discard the partial accumulation, or leave "
                "gradient_accumulation_steps at its default, 'auto', which takes what comes "
                "(the HF Trainer's short last window at an epoch's end)" + (
                    ". Under FSDP2 with set_requires_gradient_sync(False) the gradient hooks "
                    "run once per step, after the reduce-scatter: leave it at 'auto' there"
                    if _sharded.is_dtensor(self._params[0]) else "")
            )

    def _learn_rhythm(self) -> None:
        """After a completed step, with "auto": the most backward passes a step has had."""
        if self.gradient_accumulation_steps == "auto":
            self._rhythm = max(self._rhythm or 0, max(self._this_step.counts, default=0)) or None

    def _hooks_hint(self) -> str:
        return (f"If another optimizer trains these parameters now, this {type(self).__name__} "
                "is still alive (an LR scheduler or a framework holds it) and still hooked to "
                "them: call its close() first")

    def _hand_over_the_rest(self) -> None:
        """Hands the engine every chunk that got a gradient and is not with it yet. A
        parameter without a gradient in such a chunk is updated with zeros by the engine; torch
        leaves it alone (one whose .grad is None; a zeroed .grad is a gradient), so its states
        are saved here and put back after the step (_restore_untouched), and its .grad stays
        None. Torch's per-parameter step count has no equivalent: the chunk's advances."""
        def has_gradient(i: int) -> bool:
            return self._params[i].grad is not None

        step = self._this_step
        chunks = [c for c, members in enumerate(self._members)
                  if not step.submitted[c] and any(has_gradient(i) for i in members)]
        self._save_untouched([i for c in chunks for i in self._members[c]
                              if not has_gradient(i)])
        for c in chunks:
            for i in self._members[c]:
                # Placed before too, when .grad was replaced since (nothing to copy otherwise).
                self._place_gradient(i)
            self._submit(c)

    def _save_untouched(self, indices: list[int]) -> None:
        """Saves the master and states of parameters without a gradient this step, to be put
        back after it (_restore_untouched): the engine updates them with zeros, torch not."""
        kinds = [MASTER, *self._state_names]
        saved = [(i, k) for i in indices for k in kinds]
        self._this_step.untouched += [
            (i, k, v) for (i, k), v in zip(saved, self._read_states(saved))]

    def _sync_handed_gradients(self) -> None:
        """Rechecking, at step(): a handed-over parameter whose ``.grad`` the trainer replaced
        gets the new one copied into its chunk's buffer, where the engine's recheck sees it.
        One whose ``.grad`` became None is skipped by torch, which a chunk already with the
        engine cannot do: the engine drops this step and every chunk goes again
        (_hand_over_the_rest keeps such parameters' states as they were)."""
        handed = [i for c in self._this_step.handed() for i in self._members[c]]
        if any(self._params[i].grad is None for i in handed):
            self._take_back()
            return
        for i in handed:
            # A mirrored parameter's gradient is FSDP2's or DDP's, copied in: copied again.
            if self._params[i].grad is not self._grad_views[i]:
                self._place_gradient(i)

    def _take_back(self) -> None:
        """Rechecking: the engine drops the open step (its gradients and every update made
        ahead of step()), so no chunk is with it any more; the gradients stay in ``.grad``."""
        with self._on_device():
            self._engine.abandon_step()
        self._this_step.took_back()

    def _restart_discarded_counts(self) -> None:
        """After _take_back in a backward: a parameter whose ``.grad`` is no longer its chunk's
        buffer (set to None by zero_grad, or replaced) starts counting backward passes again;
        one whose ``.grad`` still is accumulates on."""
        step = self._this_step
        step.restart([i for i in range(len(self._params))
                      if step.placed[i] and not self._holds_placed_gradient(i)], self._members)

    def _restore_untouched(self) -> None:
        """Puts back the states saved by _hand_over_the_rest; on an error they stay pending
        and the next step or state access tries again."""
        if self._restore_pending:
            self._write_states([(i, k, v, "a saved state") for i, k, v in self._restore_pending])
            self._restore_pending = []

    def _place_gradient(self, i: int) -> None:
        """Puts parameter i's accumulated gradient into its chunk's gradient buffer and makes
        ``.grad`` a view of it (a no-op when autograd accumulated into that view). A parameter
        without a gradient gets zeros there and keeps ``.grad`` None."""
        p = self._params[i]
        view = self._grad_views[i]
        grad = p.grad
        if grad is None:
            view.zero_()
        elif self._layout.mirrors:
            # The gradient is FSDP2's or DDP's (they accumulate into it): the chunk gets a copy.
            view.copy_(self._layout.local(i, grad))
            self._this_step.placed_gradient[i] = grad
        else:
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            p.grad = view
        chunk = self._chunk_of[i]
        self._this_step.placed[i] = True
        self._this_step.placed_version[chunk] = self._chunk_grads[chunk]._version

    def _holds_placed_gradient(self, i: int) -> bool:
        """Whether parameter i's ``.grad`` is still the gradient _place_gradient placed (not
        set to None or replaced since): its chunk's buffer, or, mirrored, the same tensor."""
        grad = self._params[i].grad
        if self._layout.mirrors:
            return grad is not None and grad is self._this_step.placed_gradient.get(i)
        return grad is self._grad_views[i]

    def _submit(self, chunk: int) -> None:
        stream = self._stream()
        with self._on_device():
            self._engine.acquire(chunk)
            try:
                self._engine.grads_ready(chunk, stream)
            finally:
                self._engine.release(chunk, stream)
        self._this_step.submitted[chunk] = True
        self._this_step.placed_version[chunk] = self._chunk_grads[chunk]._version

    def _gradients_modified_after_backward(self) -> str | None:
        """Which parameters' gradients changed (or were replaced) after the engine took them."""
        changed = []
        for chunk, members in enumerate(self._members):
            if not self._this_step.submitted[chunk]:
                continue
            if self._chunk_grads[chunk]._version != self._this_step.placed_version[chunk]:
                changed.append(f"chunk {chunk}'s parameters {members[0]}..{members[-1]}")
                continue
            for i in members:
                if (self._this_step.counts[i] > 0
                        and self._params[i].grad is not self._grad_views[i]):
                    changed.append(f"parameter {i}")
        return ", ".join(changed) if changed else None

    def _refuse_grad_scaler(self) -> None:
        scale = getattr(self, "grad_scale", None)
        if scale is None and getattr(self, "found_inf", None) is None:
            return
        self.grad_scale = self.found_inf = None
        name = type(self).__name__
        advice = ("Use fp16 parameters with opt.scale(loss).backward() (the engine scales, checks "
                  "and skips), or bf16")
        if not self._this_step.handed():
            self._reset_step()
            super().zero_grad(set_to_none=True)
            raise NotImplementedError(
                f"torch.amp.GradScaler does not work with {name}: this step was discarded. "
                f"{advice}")
        scale_value = float(scale) if scale is not None else float("nan")
        self._close(
            "torch.amp.GradScaler was used with it: chunks had already been updated with "
            f"gradients multiplied by the loss scale ({scale_value:g}), so its parameters and "
            "states are corrupted")
        raise NotImplementedError(
            f"torch.amp.GradScaler does not work with {name}: the updates start during "
            "backward, before the scaler could unscale the gradients, so chunks were updated "
            f"with gradients multiplied by the loss scale ({scale_value:g}) and the parameters "
            "and optimizer states are corrupted; reload both from a checkpoint into a new "
            f"optimizer. {advice}")

    def _check_open(self, what: str, closure_given: bool = False) -> None:
        """Refuses calls on a closed optimizer, and anything but a plain step() while a failed
        step waits for its retry."""
        if self._closed is not None:
            raise RuntimeError(f"{what} on a closed {type(self).__name__}: {self._closed}")
        if self._retry_pending and (what != "step()" or closure_given):
            raise RuntimeError(
                f"{what} while the last step() failed and waits for its retry: call opt.step() "
                "(without a closure) again to retry it first")

    def _close(self, reason: str) -> None:
        """Gives the parameters their own memory, removes the hooks, and refuses every later
        call with `reason`."""
        self._finalizer()
        self._closed = reason

    # -------------------------------------------------------------- parameters and states

    def _adopt_parameter_changes(self, everything: bool = False) -> None:
        """Parameters written in place since the engine last set them (model.load_state_dict,
        an in-place init under no_grad; every parameter with `everything`) become their
        masters where they differ from the master rounded to the working dtype, so a write of
        the same values (an EMA swap and back) keeps the fp32 masters. A parameter whose
        ``.data`` was replaced is copied in and pointed back at its chunk. Offloaded
        parameters (offload_parameters) are written only through model.load_state_dict, whose
        hooks write their masters."""
        if self._residency is not None:
            return
        self._refuse_cast_or_moved()
        changed = {}
        versions = self._versions()
        for i, p in enumerate(self._params):
            # A mirrored parameter's memory is not the chunk's: only its values can change.
            replaced = not self._layout.mirrors and (
                p.data_ptr() != self._param_views[i].data_ptr())
            if everything or replaced or versions[i] != self._param_versions[i]:
                changed[i] = (_flat_fp32(self._layout.local(i, p), copy=True), replaced)
        # Every new value is read before any is written: writing one master rewrites the working
        # values of its whole chunk from the masters, undoing the others' in-place changes.
        if changed and self._params[0].dtype != torch.float32:
            dtype = self._params[0].dtype
            masters = self._read_states([(i, MASTER) for i in changed])
            for (i, (values, replaced)), master in zip(list(changed.items()), masters):
                same = master.to(dtype).float() == values
                changed[i] = (torch.where(same, master, values), replaced)
        self._write_states([(i, MASTER, values, "the parameter's new value")
                            for i, (values, _) in changed.items()])
        for i, (_, replaced) in changed.items():
            if replaced:
                self._params[i].data = self._param_views[i]
        self._param_versions = self._versions()

    def _versions(self) -> list[int]:
        """Each parameter's version counter (its part's, mirrored): what finds writes to it."""
        return [self._layout.local(i, p)._version for i, p in enumerate(self._params)]

    def _publish_parts(self, local_only: bool = False) -> None:
        """Mirrored: the chunks' values (the step's update, a loaded master) into the
        parameters' parts, and with StateShards (not `local_only`) all-gathered across ranks."""
        if local_only:
            self._layout.publish_local(self._param_views)
        else:
            self._layout.publish(self._param_views, self._trained_indices)
        self._param_versions = self._versions()

    def _refuse_cast_or_moved(self) -> None:
        """A model cast (``model.to(torch.bfloat16)``) or moved (``model.to("cuda")``) after the
        optimizer was built: its parameters no longer live in the engine's chunks, and copying
        their values back would silently undo the cast. Refused before anything changes."""
        dtype = self._param_views[0].dtype
        for i, p in enumerate(self._params):
            if p.dtype != dtype or p.device != self._device:
                raise RuntimeError(
                    f"parameter {i} (shape {tuple(p.shape)}) is now {p.dtype} on {p.device}, "
                    f"but {type(self).__name__} was built for {dtype} on {self._device}: the "
                    "engine lays the parameters out in that dtype and on that device at "
                    "construction. Cast or move the model first, then build the optimizer "
                    "(model.to(...); opt = " + type(self).__name__ + "(model.parameters(), ...)); "
                    "to keep this optimizer, cast the model back"
                )

    def _read_states(self, wanted: list[tuple[int, int]]) -> list[torch.Tensor]:
        """States (parameter index, kind) as flat fp32 tensors, in one engine call."""
        if not wanted:
            return []
        out = [torch.empty(self._engine_numel[i], dtype=torch.float32) for i, _ in wanted]
        with self._on_device():
            self._engine.read_states([(i, kind, o.numpy()) for (i, kind), o in zip(wanted, out)])
        return out

    def _write_states(self, writes: list[tuple[int, int, Any, str]]) -> None:
        """(parameter index, kind, values, what they are) in one engine call."""
        self._write_state_batch(self._state_batch(writes))

    def _state_batch(self, writes: list[tuple[int, int, Any, str]]) -> list[tuple]:
        """The engine's batch for `writes`, every size checked (ValueError naming the
        parameter)."""
        batch = []
        for i, kind, values, what in writes:
            try:
                tensor = self._layout.local_state(i, values, self._engine_numel[i])
            except ValueError as e:
                raise ValueError(f"{what} of parameter {i} {e}") from None
            batch.append((i, kind, tensor.numpy()))
        return batch

    def _write_state_batch(self, batch: list[tuple]) -> None:
        if batch:
            with self._on_device():
                self._engine.write_states(batch)
            if self._layout.mirrors and any(kind == MASTER for _, kind, _ in batch):
                # Masters rewrite the chunks' working values. Every rank's part only: a write
                # need not happen on every rank (a parameter loaded on one), so no collective.
                self._publish_parts(local_only=True)

    def _check_between_steps(self, what: str) -> None:
        if self._this_step.open:
            raise RuntimeError(
                f"{what} between backward() and step(): the engine is updating with this "
                "step's gradients; call it after step()"
            )

    # ----------------------------------------------------------------- device and exit

    def _stream(self) -> int:
        return _device.trainer_stream(self._device)

    def _on_device(self) -> contextlib.AbstractContextManager:
        return _device.selected(self._device)


class _GradHook:
    """A parameter's post-accumulate-grad hook; holds its optimizer weakly, so that the
    optimizer can be collected (and give its parameters their own memory) while the model
    lives."""

    def __init__(self, optimizer: OffloadOptimizer, index: int) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._index = index

    def __call__(self, _: torch.Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._on_gradient(self._index)


def _flat_fp32(part: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """A parameter's part (Layout.local) as a flat, contiguous fp32 host tensor of the
    engine's numel: an empty part's stand-in is one zero."""
    if part.numel() == 0:
        return torch.zeros(1)
    return part.detach().reshape(-1).to("cpu", torch.float32, copy=copy).contiguous()
