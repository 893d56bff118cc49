"""torch.optim optimizers backed by Strata's offload engine.

How it works, in the terms of engine.h's trainer contract:

* At construction every parameter is registered with the engine (in param_groups order, which
  is also state_dict's numbering) and packed into chunks. Each parameter's ``.data`` then becomes
  a view into its chunk's device memory (as FSDP's FlatParameter does), which stays put for the
  engine's life: the model, its hooks and ``model.state_dict()`` keep working on the same
  ``Parameter`` objects.
* A post-accumulate-grad hook on every trained parameter counts backward passes. On the last
  micro-step of a step (``gradient_accumulation_steps``), the parameter's gradient is placed in
  its chunk's gradient buffer (``.grad`` becomes a view of it; when autograd already accumulated
  into that view nothing is copied), and once every parameter of a chunk has its gradient the
  chunk is handed to the engine, whose CPU update starts while backward goes on.
* ``step()`` hands over the chunks still waiting (parameters that got gradients in only some
  micro-steps), waits for every update, and returns with the parameters updated in place.

Hyper-parameters: the engine fixes betas, eps and each group's weight decay at construction;
the learning rate is read from ``param_groups`` at the first backward of every step, so any
``torch.optim.lr_scheduler`` works as long as the groups keep the ratios of their learning rates
(every built-in scheduler does, except per-group lambdas and a nonzero ``eta_min``); a change the
engine cannot follow raises instead of being ignored.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from strata import _strata

_WORKING_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_MASTER, _EXP_AVG, _EXP_AVG_SQ = 0, 1, 2
# Tolerance for "the same learning-rate ratio": schedulers compute each group's lr in floating
# point, so the ratios of two groups drift in the last bits.
_LR_RATIO_TOLERANCE = 1e-9


class OffloadOptimizer(torch.optim.Optimizer):
    """The common part of OffloadAdamW, OffloadAdam, OffloadAdagrad and OffloadLion.

    Subclasses name the engine's update rule, the torch optimizer whose ``defaults`` and state
    names they mirror, and which hyper-parameters the engine supports.
    """

    _engine_type: str = ""
    # state_dict key of each engine state (master, exp_avg, exp_avg_sq) the rule keeps.
    _state_names: dict[int, str] = {}

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        offload: str = "cpu",
        nvme_path: str | os.PathLike | None = None,
        offload_ratio: float = 1.0,
        max_grad_norm: float = 0.0,
        gradient_accumulation_steps: int = 1,
        chunk_size: int | str = "64MiB",
        host_memory: int | str | None = None,
        cpu_threads: int = 0,
        loss_scale: float | str = "dynamic",
        speculative_updates: bool = True,
        overlap: bool = True,
        config: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be an integer >= 1, got "
                f"{gradient_accumulation_steps!r}"
            )
        if max_grad_norm is None or max_grad_norm < 0 or not math.isfinite(max_grad_norm):
            raise ValueError(f"max_grad_norm must be finite and >= 0 (0 = off), got {max_grad_norm!r}")
        _refuse_several_ranks()
        self._constructed = False
        super().__init__(params, defaults)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.max_grad_norm = float(max_grad_norm)
        # False: every chunk goes to the engine in step(), after backward (for measuring what
        # the overlap saves, and for debugging).
        self.overlap = overlap

        self._params: list[torch.nn.Parameter] = [p for g in self.param_groups for p in g["params"]]
        self._group_of: list[int] = [
            gi for gi, g in enumerate(self.param_groups) for _ in g["params"]
        ]
        self._check_parameters()
        device = self._params[0].device
        dtype = self._params[0].dtype
        self._device = device
        self._fixed = [self._fixed_hyperparameters(g) for g in self.param_groups]
        self._lr_scales = self._learning_rate_scales()

        options = self._engine_options(
            device=device,
            dtype=dtype,
            offload=offload,
            nvme_path=nvme_path,
            offload_ratio=offload_ratio,
            chunk_size=chunk_size,
            host_memory=host_memory,
            cpu_threads=cpu_threads,
            loss_scale=loss_scale,
            speculative_updates=speculative_updates,
        )
        _merge(options, config or {})
        registered = []
        for i, p in enumerate(self._params):
            group = self.param_groups[self._group_of[i]]
            values = p.detach().reshape(-1).to("cpu", torch.float32).contiguous().numpy()
            registered.append(
                (
                    f"param.{i}",
                    list(p.shape) or [1],
                    values,
                    float(group["weight_decay"]),
                    self._lr_scales[self._group_of[i]],
                    not p.requires_grad,
                )
            )
        self._engine = _strata.Engine(json.dumps(options), registered)
        _live_engines.add(self._engine)

        # Every chunk's memory, once: device-home chunks keep it for the engine's life.
        self._chunk_params: list[torch.Tensor] = []
        self._chunk_grads: list[torch.Tensor | None] = []
        for c in range(self._engine.chunk_count):
            params_view, grads_view = self._engine.acquire(c)
            self._engine.release(c)
            self._chunk_params.append(torch.from_dlpack(params_view))
            self._chunk_grads.append(None if grads_view is None else torch.from_dlpack(grads_view))
            if self._engine.chunk(c)[4] != "device":
                raise NotImplementedError("parameters offloaded from the device are not built yet")

        self._chunk_of: list[int] = []
        self._grad_views: list[torch.Tensor | None] = []
        self._members: list[list[int]] = [[] for _ in range(self._engine.chunk_count)]
        for i, p in enumerate(self._params):
            chunk, offset, numel = self._engine.location(i)
            self._chunk_of.append(chunk)
            p.data = self._chunk_params[chunk][offset : offset + numel].view(p.shape)
            grads = self._chunk_grads[chunk]
            if p.requires_grad:
                self._grad_views.append(grads[offset : offset + numel].view(p.shape))
                self._members[chunk].append(i)
                p.register_post_accumulate_grad_hook(_GradHook(self, i))
            else:
                self._grad_views.append(None)
        self._param_versions = [p._version for p in self._params]
        self._last_report: dict[str, Any] | None = None
        self._skipped_steps = 0
        self._reset_step()
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

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Waits for the updates of this step (most ran during backward) and returns the
        closure's loss, if a closure was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        most = max(self._counts, default=0)
        if most == 0:
            raise RuntimeError(
                "step() before any backward(): no parameter received a gradient since the last "
                "step()"
            )
        if most != self.gradient_accumulation_steps:
            raise RuntimeError(
                f"step() after {most} backward passes, but this optimizer was built with "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}: call step() "
                f"after every {self.gradient_accumulation_steps} backward() (or build it with "
                f"gradient_accumulation_steps={most})"
            )
        modified = self._gradients_modified_after_backward()
        for c, members in enumerate(self._members):
            if not self._submitted[c] and any(self._counts[i] > 0 for i in members):
                for i in members:
                    if not self._placed[i]:
                        self._place_gradient(i)
                self._submit(c)
        try:
            report = self._engine.step()
        finally:
            self._reset_step()
        self._last_report = report
        if report["skipped"]:
            self._skipped_steps += 1
        if modified:
            raise RuntimeError(
                f"the gradients of {modified} changed between backward() and step() (by "
                "torch.nn.utils.clip_grad_norm_, say), after the engine had started updating "
                "with them; this step used the gradients as backward left them. Pass "
                f"max_grad_norm=... to {type(self).__name__} to clip on the global norm instead"
            )
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format: per parameter index its ``step`` and moments (named as the
        matching torch optimizer names them; loadable into it), plus ``master`` (the fp32 master
        value) when the parameters are not fp32."""
        self._check_between_steps("state_dict()")
        state: dict[int, dict[str, torch.Tensor]] = {}
        steps = self._engine.step_count
        if steps > 0:
            with_master = self._params[0].dtype != torch.float32
            for i, p in enumerate(self._params):
                if not p.requires_grad:
                    continue
                entry: dict[str, torch.Tensor] = {"step": torch.tensor(float(steps))}
                names = dict(self._state_names)
                if with_master:
                    names[_MASTER] = "master"
                for kind, name in sorted(names.items()):
                    entry[name] = self._read_state(i, kind).view(p.shape)
                state[i] = entry
        groups = []
        first = 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(first, first + len(g["params"])))
            first += len(g["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this optimizer or of the matching torch optimizer (AdamW's into
        OffloadAdamW, say): hyper-parameters, moments and the step count. The parameters' values
        come from the model (``model.load_state_dict``), or from ``master`` when present."""
        self._check_between_steps("load_state_dict()")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state_dict has {len(saved_groups)} parameter groups; this optimizer has "
                f"{len(self.param_groups)}"
            )
        for gi, (mine, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(
                    f"parameter group {gi} of the state_dict has {len(saved['params'])} "
                    f"parameters; this optimizer's has {len(mine['params'])}"
                )
            fixed = self._fixed_hyperparameters(saved)
            if fixed != self._fixed[gi]:
                raise ValueError(
                    f"parameter group {gi} of the state_dict has {fixed}, this optimizer "
                    f"{self._fixed[gi]}: the engine fixes these at construction, so build "
                    f"{type(self).__name__} with the saved values"
                )
        # Values the model loaded in place become the masters before the moments go in.
        self._adopt_parameter_changes()
        index_of = {}
        first = 0
        for saved in saved_groups:
            for position, saved_index in enumerate(saved["params"]):
                index_of[saved_index] = first + position
            first += len(saved["params"])
        steps = None
        for saved_index, entry in state_dict["state"].items():
            i = index_of[saved_index]
            p = self._params[i]
            if not p.requires_grad:
                continue
            for kind, name in [(_MASTER, "master"), *self._state_names.items()]:
                if name in entry:
                    self._write_state(i, kind, entry[name], name)
            if "step" in entry:
                steps = int(float(entry["step"]))
        if steps is not None:
            self._engine.set_step_count(steps)
        for mine, saved in zip(self.param_groups, saved_groups):
            for key, value in saved.items():
                if key != "params":
                    mine[key] = value
        self._param_versions = [p._version for p in self._params]

    # ------------------------------------------------------------------------- extras

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
        grad_norm (before clipping), loss_scale, seconds."""
        return self._last_report

    def metrics(self) -> dict[str, Any]:
        """The engine's counters (bytes moved per tier, optimizer time, tier use) and the
        last step's report, as one flat dict."""
        out = dict(self._engine.counters())
        out["steps"] = self._engine.step_count
        out["iterations"] = self._engine.iteration_count
        out["skipped_steps"] = self._skipped_steps
        out["loss_scale"] = self._engine.loss_scale
        if self._last_report is not None:
            out["grad_norm"] = self._last_report["grad_norm"]
            out["step_seconds"] = self._last_report["seconds"]
        return out

    def metrics_text(self) -> str:
        """The engine's metrics in Prometheus' text format (what `strata serve` exposes)."""
        return self._engine.metrics_text()

    # ----------------------------------------------------------------------- internals

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
            if p.dtype not in _WORKING_DTYPES:
                raise ValueError(f"{name} is {p.dtype}; parameters of float32, bfloat16 or float16")
            if p.dtype != first.dtype:
                raise ValueError(
                    f"{name} is {p.dtype} but parameter 0 is {first.dtype}: the engine keeps "
                    "one working dtype (and fp32 masters); cast the model with model.to(dtype)"
                )
            if p.is_sparse:
                raise ValueError(f"{name} is sparse; dense parameters only")

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

    def _engine_options(self, *, device, dtype, offload, nvme_path, offload_ratio, chunk_size,
                        host_memory, cpu_threads, loss_scale, speculative_updates) -> dict:
        group = self.param_groups[0]
        tiers = {"cpu": "host", "host": "host", "nvme": "nvme", "none": "device", None: "device"}
        if offload not in tiers:
            raise ValueError(f"offload must be 'cpu', 'nvme' or None, got {offload!r}")
        states = tiers[offload]
        optimizer: dict[str, Any] = {
            "type": self._engine_type,
            "lr": max(float(g["lr"]) for g in self.param_groups),
            "weight_decay": float(self.defaults.get("weight_decay", 0.0)),
            "gradient_clipping": self.max_grad_norm,
            "gradient_accumulation_steps": 1,  # torch accumulates in .grad; see _GradHook.
            "cpu_threads": cpu_threads,
            "speculative_updates": speculative_updates,
        }
        if "betas" in group:
            optimizer["beta1"], optimizer["beta2"] = (float(b) for b in group["betas"])
        if "eps" in group:
            optimizer["eps"] = float(group["eps"])
        precision: dict[str, Any] = {"working_dtype": _WORKING_DTYPES[dtype]}
        if dtype == torch.float16:
            precision["loss_scale"] = 0.0 if loss_scale == "dynamic" else float(loss_scale)
        options: dict[str, Any] = {
            "device": {"kind": "cuda", "cuda_device": device.index or 0}
            if device.type == "cuda"
            else {"kind": "host"},
            "optimizer": optimizer,
            "precision": precision,
            "placement": {
                "zero_stage": 0,
                "optimizer_states": states,
                "offload_ratio": float(offload_ratio),
                "params": "device",
                "chunk_bytes": chunk_size,
            },
        }
        if states == "nvme":
            if nvme_path is None:
                raise ValueError("offload='nvme' needs nvme_path (a directory on the NVMe drive)")
            if not os.path.isdir(nvme_path):
                raise FileNotFoundError(f"nvme_path {os.fspath(nvme_path)!r} is not a directory")
            options["nvme"] = {"paths": [os.fspath(nvme_path)]}
        if host_memory is not None:
            options["host"] = {"pinned_memory_bytes": host_memory}
        if device.type == "cuda":
            options.setdefault("host", {})["pin_memory"] = True
        return options

    def _reset_step(self) -> None:
        n = len(self._params)
        self._counts = [0] * n
        self._placed = [False] * n  # Its gradient is in its chunk's buffer (_place_gradient).
        self._waiting = [len(m) for m in self._members]  # Members still without their gradient.
        self._submitted = [False] * len(self._members)
        self._placed_version: dict[int, int] = {}  # chunk -> its gradients' version once placed.
        self._step_open = False

    def _begin_step(self) -> None:
        """At the first gradient of a step: what torch-side code changed since the last step
        (parameters loaded in place, a scheduler's learning rate) reaches the engine."""
        self._adopt_parameter_changes()
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
        self._engine.set_learning_rate(base)
        self._step_open = True

    def _adopt_parameter_changes(self) -> None:
        """Parameters written in place since the engine last set them (model.load_state_dict,
        an in-place init under no_grad) become their masters; a parameter whose ``.data`` was
        replaced is copied in and pointed back at its chunk."""
        changed = {}
        for i, p in enumerate(self._params):
            chunk, offset, numel = self._engine.location(i)
            view = self._chunk_params[chunk][offset : offset + numel]
            replaced = p.data_ptr() != view.data_ptr()
            if replaced or p._version != self._param_versions[i]:
                changed[i] = (p.detach().reshape(-1).to("cpu", torch.float32, copy=True), replaced)
        # Every new value is read before any is written: writing one master rewrites the working
        # values of its whole chunk from the masters, undoing the others' in-place changes.
        for i, (values, replaced) in changed.items():
            self._write_state(i, _MASTER, values, "the parameter's new value")
            if replaced:
                chunk, offset, numel = self._engine.location(i)
                p = self._params[i]
                p.data = self._chunk_params[chunk][offset : offset + numel].view(p.shape)
        self._param_versions = [p._version for p in self._params]

    def _place_gradient(self, i: int) -> None:
        """Puts parameter i's accumulated gradient into its chunk's gradient buffer and makes
        ``.grad`` a view of it (a no-op when autograd accumulated into that view)."""
        p = self._params[i]
        view = self._grad_views[i]
        grad = p.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        p.grad = view
        self._placed[i] = True
        self._placed_version[self._chunk_of[i]] = self._chunk_grads[self._chunk_of[i]]._version

    def _on_gradient(self, i: int) -> None:
        """Parameter i's post-accumulate-grad hook: one more backward pass reached it."""
        if not self._step_open:
            self._begin_step()
        self._counts[i] += 1
        gas = self.gradient_accumulation_steps
        if self._counts[i] > gas:
            raise RuntimeError(
                f"parameter {i} (shape {tuple(self._params[i].shape)}) received its gradient "
                f"{self._counts[i]} times since the last step(), but this optimizer was built "
                f"with gradient_accumulation_steps={gas}: call step() after every {gas} "
                "backward()"
            )
        if self._counts[i] < gas or not self.overlap:
            return
        self._place_gradient(i)
        chunk = self._chunk_of[i]
        self._waiting[chunk] -= 1
        if self._waiting[chunk] == 0:
            self._submit(chunk)

    def _submit(self, chunk: int) -> None:
        stream = self._stream()
        self._engine.acquire(chunk)
        try:
            self._engine.grads_ready(chunk, stream)
        finally:
            self._engine.release(chunk, stream)
        self._submitted[chunk] = True
        self._placed_version[chunk] = self._chunk_grads[chunk]._version

    def _gradients_modified_after_backward(self) -> str | None:
        """Which parameters' gradients changed (or were replaced) after the engine took them."""
        changed = []
        for chunk, members in enumerate(self._members):
            if not self._submitted[chunk]:
                continue
            if self._chunk_grads[chunk]._version != self._placed_version[chunk]:
                changed.append(f"chunk {chunk}'s parameters {members[0]}..{members[-1]}")
                continue
            for i in members:
                if self._params[i].grad is not self._grad_views[i]:
                    changed.append(f"parameter {i}")
        return ", ".join(changed) if changed else None

    def _stream(self) -> int:
        if self._device.type != "cuda":
            return 0  # CPU tensors: torch's work is done when the hook runs.
        # torch's legacy default stream has handle 0, which the engine reads as its own compute
        # stream; cudaStreamLegacy (1) names the legacy stream explicitly.
        return torch.cuda.current_stream(self._device).cuda_stream or 1

    def _read_state(self, i: int, kind: int) -> torch.Tensor:
        out = torch.empty(self._params[i].numel(), dtype=torch.float32)
        self._engine.read_state(i, kind, out.numpy())
        return out

    def _write_state(self, i: int, kind: int, values: Any, what: str) -> None:
        tensor = torch.as_tensor(values).detach().to("cpu", torch.float32).reshape(-1).contiguous()
        if tensor.numel() != self._params[i].numel():
            raise ValueError(
                f"{what} of parameter {i} has {tensor.numel()} elements; the parameter has "
                f"{self._params[i].numel()}"
            )
        self._engine.write_state(i, kind, tensor.numpy())

    def _check_between_steps(self, what: str) -> None:
        if self._step_open:
            raise RuntimeError(
                f"{what} between backward() and step(): the engine is updating with this "
                "step's gradients; call it after step()"
            )


# Engines still alive at exit (their parameters may outlive the module): each stops its
# threads and removes its NVMe files then, as its destructor would.
_live_engines: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shut_down_engines() -> None:
    for engine in list(_live_engines):
        engine._shutdown()


class _GradHook:
    """A parameter's post-accumulate-grad hook; holds its optimizer weakly, so a model
    outliving its optimizer does not keep the engine's states alive."""

    def __init__(self, optimizer: OffloadOptimizer, index: int) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._index = index

    def __call__(self, _: torch.Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._on_gradient(self._index)


def _refuse_several_ranks() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise NotImplementedError(
            "strata.torch optimizers across several ranks (torchrun, ZeRO sharding) are not "
            "built yet; run one process per model"
        )


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    """Deep-merges `extra` (a Strata-format config fragment) into `into`."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _torch_defaults(reference: type[torch.optim.Optimizer], **kwargs: Any) -> dict[str, Any]:
    """The defaults a torch optimizer builds from these arguments, with every key its
    param_groups carry in this torch version (so state_dicts load into it both ways)."""
    return dict(reference([torch.nn.Parameter(torch.zeros(1))], **kwargs).defaults)


def _refuse(name: str, value: Any, supported: Any) -> None:
    if value != supported:
        raise NotImplementedError(f"{name}={value!r} is not built yet (only {supported!r})")


class OffloadAdamW(OffloadOptimizer):
    """torch.optim.AdamW with its states (fp32 master, exp_avg, exp_avg_sq) offloaded.

    Offload options (keyword-only): ``offload`` ("cpu" for host memory, "nvme", or None to keep
    them on the device), ``nvme_path``, ``offload_ratio`` (DeepSpeed's ``ratio``: the fraction
    offloaded), ``max_grad_norm`` (clip on the global norm; 0 = off),
    ``gradient_accumulation_steps`` (backward passes per step), ``chunk_size`` (bytes of working
    parameters per chunk: the unit of overlap), ``host_memory`` (budget; default 80% of RAM),
    ``cpu_threads``, ``loss_scale`` (fp16: "dynamic" or a fixed scale), ``speculative_updates``
    and ``config`` (a Strata-format config fragment merged over the rest).
    """

    _engine_type = "adamw"
    _state_names = {_EXP_AVG: "exp_avg", _EXP_AVG_SQ: "exp_avg_sq"}

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, **offload: Any) -> None:
        _refuse("amsgrad", amsgrad, False)
        _refuse("maximize", maximize, False)
        defaults = _torch_defaults(torch.optim.AdamW, lr=lr, betas=betas, eps=eps,
                                   weight_decay=weight_decay)
        super().__init__(params, defaults, **offload)


class OffloadAdam(OffloadOptimizer):
    """torch.optim.Adam (L2 weight decay added to the gradient) with its states offloaded; the
    offload options are OffloadAdamW's."""

    _engine_type = "adam"
    _state_names = {_EXP_AVG: "exp_avg", _EXP_AVG_SQ: "exp_avg_sq"}

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 maximize: bool = False, **offload: Any) -> None:
        _refuse("amsgrad", amsgrad, False)
        _refuse("maximize", maximize, False)
        defaults = _torch_defaults(torch.optim.Adam, lr=lr, betas=betas, eps=eps,
                                   weight_decay=weight_decay)
        super().__init__(params, defaults, **offload)


class OffloadAdagrad(OffloadOptimizer):
    """torch.optim.Adagrad (lr_decay 0, initial_accumulator_value 0) with its sum of squares
    offloaded; the offload options are OffloadAdamW's."""

    _engine_type = "adagrad"
    _state_names = {_EXP_AVG_SQ: "sum"}

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, *,
                 maximize: bool = False, **offload: Any) -> None:
        _refuse("lr_decay", lr_decay, 0.0)
        _refuse("initial_accumulator_value", initial_accumulator_value, 0.0)
        _refuse("maximize", maximize, False)
        defaults = _torch_defaults(torch.optim.Adagrad, lr=lr, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, **offload)


class OffloadLion(OffloadOptimizer):
    """Lion (Chen et al. 2023; torch has none) with its momentum offloaded; the offload options
    are OffloadAdamW's. Lion's lr is typically 3-10x smaller than AdamW's."""

    _engine_type = "lion"
    _state_names = {_EXP_AVG: "exp_avg"}

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, **offload: Any) -> None:
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        super().__init__(params, defaults, **offload)
