"""Parameters that live off the device between uses: ZeRO-3's ``offload_param``, from PyTorch.

``offload_parameters(model, ...)`` marks a model. The strata optimizer built on its parameters
registers them with the engine with their home in host memory or on NVMe (placement.params) and
hands them to a ParameterResidency, which keeps a parameter on the device only while a module
that owns it runs, forward or backward:

* Each parameter keeps one storage for its life, emptied (resized to 0) between uses and refilled
  from the engine's device copy of its chunk when a module needs it, as FSDP2 does with its
  unsharded parameters. Autograd saves views of parameters (``linear`` saves ``weight.t()``);
  those views stay valid because backward refills the same storage object. Between uses
  ``.data`` is a storage-less stand-in of the parameter's shape whose every read raises a clear
  error, so ``named_parameters()`` keeps names and shapes.
* A module's forward pre-hook takes the chunks of the parameters it owns (the engine fetches
  them, and those the first step's order expects next), fills their storages and lets the
  engine's copy go; its forward post-hook empties them and, when its output needs gradients,
  hooks that output so that backward takes them again before it reaches the module
  (register_multi_grad_hook, as FSDP2).
* In backward the engine's copy of a trained chunk stays acquired: each parameter's
  post-accumulate-grad hook copies its gradient into the chunk's gradient buffer (``.grad``
  then says where it went); once every trained parameter of the chunk has one, the chunk goes
  to the engine (GradsReady: its update may start at once) and is let go. The engine sums
  micro-steps, so gradient accumulation needs its count up front, and a chunk that missed a
  micro-step gets zeros for it. A frozen chunk is let go at the end of the backward pass that
  took it.

``model.state_dict()`` and ``load_state_dict`` see real values: hooks fill the parameters from
the engine's masters around them and write loaded values back as masters.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree

from strata import _log, _strata
from strata.torch import _device
from strata.torch._state_dict import MASTER

_OFFLOAD_TIERS = {"cpu": "host", "host": "host", "nvme": "nvme"}

# id(parameter) -> (the parameter, held weakly; its model's plan, which holds the model weakly).
_planned: dict[int, tuple[weakref.ref, "OffloadPlan"]] = {}


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """What offload_parameters() asked for one model."""

    tier: str                  # The engine's placement.params: "host" or "nvme".
    nvme_path: str | None
    device_memory: int | None  # Bytes of the engine's device budget; None = the engine's own.
    model: weakref.ref


def offload_parameters(model: torch.nn.Module, offload: str = "cpu", *,
                       nvme_path: Any = None,
                       device_memory: int | str | None = None) -> torch.nn.Module:
    """Keeps ``model``'s parameters in host memory (``offload="cpu"``) or on NVMe
    (``offload="nvme"``, under ``nvme_path``) between uses, as DeepSpeed's ZeRO-3
    ``offload_param`` does: the device holds a module's parameters while it runs, fetched ahead
    in the order the first step recorded, and their gradients leave it as soon as backward has
    produced them. ``device_memory`` (bytes, or "2GiB") bounds the engine's device copies of
    parameters and gradients.

    Call it before building the optimizer, which does the offloading (a strata optimizer over
    ``model.parameters()``); until then the model is untouched. Every parameter must be used
    inside the forward of a module that owns it (as FSDP requires). Returns ``model``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload_parameters takes an nn.Module, got {type(model).__name__}")
    if offload not in _OFFLOAD_TIERS:
        raise ValueError(f"offload must be 'cpu' or 'nvme', got {offload!r}")
    tier = _OFFLOAD_TIERS[offload]
    if tier == "nvme":
        if nvme_path is None:
            raise ValueError("offload='nvme' needs nvme_path (a directory on the NVMe drive)")
        if not os.path.isdir(nvme_path):
            raise FileNotFoundError(f"nvme_path {os.fspath(nvme_path)!r} is not a directory")
        nvme_path = os.fspath(nvme_path)
    if device_memory is not None:
        device_memory = (_strata.parse_bytes(device_memory) if isinstance(device_memory, str)
                         else int(device_memory))
        if device_memory <= 0:
            raise ValueError(f"device_memory must be positive, got {device_memory}")
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters to offload")
    plan = OffloadPlan(tier, nvme_path, device_memory, weakref.ref(model))
    for p in params:
        _planned[id(p)] = (weakref.ref(p), plan)
    return model


def plan_of(params: list[torch.Tensor]) -> OffloadPlan | None:
    """The plan that covers `params` (an optimizer's), None when none does. ValueError when
    only some are covered, or by different models' plans."""
    for key in [k for k, (p, plan) in _planned.items() if p() is None or plan.model() is None]:
        del _planned[key]
    plans = []
    for p in params:
        ref, plan = _planned.get(id(p), (lambda: None, None))
        plans.append(plan if ref() is p else None)
    if all(plan is None for plan in plans):
        return None
    first = next(plan for plan in plans if plan is not None)
    for i, plan in enumerate(plans):
        if plan is not first:
            raise ValueError(
                f"parameter {i} (shape {tuple(params[i].shape)}) is "
                + ("not in the model given to offload_parameters()" if plan is None
                   else "in another model given to offload_parameters()")
                + ": build the optimizer over that one model's parameters")
    return first


class ParameterResidency:
    """Puts an optimizer's offloaded parameters on the device while their modules use them
    (see the module docstring). One per optimizer; everything runs on the trainer's thread (or
    autograd's, which runs one hook at a time). It holds no reference to its optimizer that
    would keep it alive: the optimizer's finalizer (remove) must be able to run."""

    def __init__(self, optimizer: Any, plan: OffloadPlan) -> None:
        model = plan.model()
        self._optimizer = weakref.ref(optimizer)
        self._engine = optimizer._engine
        params: list[torch.nn.Parameter] = optimizer._params
        self._params = [weakref.ref(p) for p in params]
        self._shapes = [p.shape for p in params]
        self._dtype = params[0].dtype
        self._device = params[0].device
        self._chunk_of: list[int] = optimizer._chunk_of
        self._trained: list[bool] = optimizer._trained
        self.accumulation: int = optimizer._engine_accumulation()
        chunk_count = self._engine.chunk_count
        # Each parameter's place in its chunk: (offset, numel).
        self._place = [self._engine.location(i)[1:] for i in range(len(params))]
        self._members: list[list[int]] = [[] for _ in range(chunk_count)]
        for i, c in enumerate(self._chunk_of):
            self._members[c].append(i)
        # Each parameter's own storage, full while in use and empty between uses, and the
        # stand-in .data points at then.
        self._homes: list[torch.Tensor] = []
        self._absent: list[torch.Tensor] = []
        self._gone: list[torch.Tensor] = []  # What .grad holds once handed to the engine.
        for i, p in enumerate(params):
            home = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            home.untyped_storage().resize_(0)
            self._homes.append(home)
            self._absent.append(_unreadable(
                p, f"parameter {i} (shape {tuple(p.shape)}) is offloaded by "
                "strata.torch.offload_parameters and is on the device only while a module that "
                "owns it runs: read it inside that module's forward, or through "
                "model.state_dict()"))
            self._gone.append(_unreadable(
                p, f"the gradient of parameter {i} (shape {tuple(p.shape)}) went to the engine "
                "during backward (strata.torch.offload_parameters): clip with the optimizer's "
                "max_grad_norm (DeepSpeed's gradient_clipping) and read the norm from "
                "opt.last_step['grad_norm']"))
            p.data = self._absent[i]
            p.grad = None
        self._bytes_of = [sum(self._place[i][1] for i in m) * params[0].element_size()
                          for m in self._members]
        # Reasons each chunk's parameters are filled: forward calls running, and one for
        # backward's hold.
        self._uses = [0] * chunk_count
        # Backward's hold: the graph task that took it, per chunk (None = not held).
        self._backward_task: list[int | None] = [None] * chunk_count
        self._grad_buffer: list[torch.Tensor | None] = [None] * chunk_count
        # Per trained chunk, this backward: parameters still without their gradient.
        self._waiting = [0] * chunk_count
        self._has_gradient = [False] * len(params)
        # Whether each parameter had a gradient in any backward pass of this step.
        self._had_gradient = [False] * len(params)
        # Per chunk: backward passes handed to the engine since the last step.
        self.handed = [0] * chunk_count
        # Graph tasks whose end-of-backward callback is queued, and the first of them: the
        # outermost backward pass (reentrant checkpointing runs nested ones inside it).
        self._callbacks_queued: set[int] = set()
        self._outermost: int | None = None
        # A state_dict or load_state_dict call (see _lend): the parameters given memory of
        # their own (a dict: ordered, fast to look up) and the modules' hooks still open.
        self._session: dict[int, None] = {}
        self._session_in_use: dict[int, None] = {}
        self._session_depth = 0
        # The chunks each module's forward calls running took, innermost call last.
        self._running: dict[int, list[list[int]]] = {}
        self.filled_bytes = 0
        self.peak_filled_bytes = 0
        self._index = {id(p): i for i, p in enumerate(params)}
        self._hooks = self._install(model, self._index)
        left_out = [p for p in model.parameters() if id(p) not in {id(q) for q in params}]
        if left_out:
            mib = sum(p.numel() * p.element_size() for p in left_out) / 2**20
            warnings.warn(
                f"{len(left_out)} parameters of the offloaded model ({mib:.1f} MiB) are not in "
                f"the optimizer and stay on the device: build the optimizer over "
                "model.parameters() (frozen ones included: they stay frozen) to offload them too",
                _log.StrataWarning, stacklevel=4)

    # ------------------------------------------------------------------ what the optimizer uses

    def handed_chunks(self) -> list[int]:
        return [c for c, n in enumerate(self.handed) if n]

    def backward_passes(self) -> int:
        return max(self.handed, default=0)

    def before_step(self) -> None:
        """step(): hands every chunk that took part in this step zeros for the micro-steps it
        missed, up to gradient_accumulation_steps. The engine sums micro-steps, so the sum is
        torch's: a module used in some micro-steps only, and a window cut short (the HF
        Trainer's last at an epoch's end: step() after fewer backward passes) train as in
        torch."""
        self.after_interruption()
        busy = [c for c, n in enumerate(self._uses) if n]
        if busy:
            raise RuntimeError(f"step() while a forward pass holds chunks {busy}")
        self._keep_untouched([c for c, n in enumerate(self.handed)
                              if 0 < n < self.accumulation])
        for c, n in enumerate(self.handed):
            for _ in range(n, self.accumulation if n else 0):
                with self._on_device():
                    _, grads = self._engine.acquire(c)
                    try:
                        torch.from_dlpack(grads).zero_()
                        self._engine.grads_ready(c, self._stream())
                    finally:
                        self._engine.release(c, self._stream())
                self.handed[c] += 1

    def _keep_untouched(self, last: list[int]) -> None:
        """Before the last hand-over of chunks `last`: the states of their parameters without
        a gradient in this whole step, which the engine updates with zeros and torch leaves
        alone, are saved to be put back after the step (the optimizer's untouched states)."""
        never = [i for c in last for i in self._members[c] if not self._had_gradient[i]]
        optimizer = self._optimizer()
        if never and optimizer is not None:
            optimizer._save_untouched(never)

    def step_done(self) -> None:
        self.handed = [0] * len(self.handed)
        self._had_gradient = [False] * len(self._had_gradient)

    def clear_gradients(self) -> None:
        """zero_grad(): .grad is None (what it held went to the engine)."""
        self.after_interruption()
        for ref in self._params:
            p = ref()
            if p is not None:
                p.grad = None

    def after_interruption(self) -> None:
        """Outside forward and backward: lets go of what a forward or backward pass that
        stopped by an exception still holds (a backward that raised never reaches its end
        callback; KeyboardInterrupt skips even always_call forward hooks). What went to the
        engine stays there: step() finishes that step."""
        if torch._C._current_graph_task_id() != -1:
            return
        for calls in self._running.values():
            for taken in calls:
                for c in taken:
                    self._unuse(c)
        self._running.clear()
        for c, task in enumerate(self._backward_task):
            if task is not None:
                self._let_go(c)
        self._callbacks_queued.clear()
        self._outermost = None
        if self._session_depth:  # A state_dict call that raised.
            self._session_depth = 1
            for i in self._end_session()[0]:
                self._params[i]().data = self._absent[i]

    def remove(self) -> None:
        """Gives every parameter memory of its own with its current value (the engine's
        master) and removes the hooks: the model is plain torch again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        indices = [i for i, ref in enumerate(self._params) if ref() is not None]
        if not indices:
            return
        try:
            values = self._masters(indices)
        except RuntimeError as e:
            # Collected mid-step (the loop stopped between backward and step()): the values
            # are being updated and cannot be read; the parameters stay unreadable.
            warnings.warn(f"the parameters offloaded by a collected optimizer keep no values: {e}",
                          _log.StrataWarning, stacklevel=2)
            return
        with torch.no_grad():
            for i, value in zip(indices, values):
                p = self._params[i]()
                p.data = value.to(self._device, self._dtype).view(self._shapes[i])
                if p.grad is self._gone[i]:
                    p.grad = None

    # --------------------------------------------------------------------------- the hooks

    def _install(self, model: torch.nn.Module, index: dict[int, int]) -> list[Any]:
        handles = [model.register_forward_pre_hook(_Hook(self, "_at_model_forward", None),
                                                   prepend=True),
                   model.register_forward_hook(_Hook(self, "_after_model_forward", None))]
        for module in model.modules():
            own = sorted({index[id(p)] for p in module._parameters.values()
                          if p is not None and id(p) in index})
            if own:
                chunks = sorted({self._chunk_of[i] for i in own})
                handles.append(module.register_forward_pre_hook(
                    _Hook(self, "_before_forward", chunks)))
                # always_call: a forward that raises lets go of what it took too (non-reentrant
                # checkpointing stops each recompute with an exception once it has what it
                # needs).
                handles.append(module.register_forward_hook(
                    _Hook(self, "_after_forward", chunks), always_call=True))
            elif module is not model:
                continue
            # The model's own hooks, with or without parameters of its own, make a state_dict
            # call one session (tied weights lent once).
            handles.append(module.register_state_dict_pre_hook(
                _Hook(self, "_before_state_dict", own)))
            handles.append(module.register_state_dict_post_hook(
                _Hook(self, "_after_state_dict", own)))
            handles.append(module.register_load_state_dict_pre_hook(
                _Hook(self, "_before_load", own)))
            handles.append(module.register_load_state_dict_post_hook(
                _Hook(self, "_after_load", own)))
        for i, ref in enumerate(self._params):
            if self._trained[i]:
                handles.append(ref().register_post_accumulate_grad_hook(
                    _Hook(self, "_on_gradient", i)))
        return handles

    def _at_model_forward(self, _: None, module: Any, args: Any) -> None:
        """The model's own forward starts: nothing of ours can be running unless a pass was
        interrupted (then it is let go of)."""
        self.after_interruption()

    def _after_model_forward(self, _: None, module: Any, args: Any, output: Any) -> None:
        """Hooks the model's outputs so that the outermost backward pass is the first to
        reach a hook of ours (see _after_backward)."""
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if tensors and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(
                tensors, _Hook(self, "_before_backward", []), mode="any")

    def _before_forward(self, chunks: list[int], module: Any, args: Any) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1:  # A recompute inside backward.
            self._enter_backward(task)
        elif self.backward_passes() >= self.accumulation:
            raise RuntimeError(
                f"the model runs again after {self.backward_passes()} backward passes without "
                "step(): offload_parameters hands the gradients to the engine during backward, "
                "and after the last micro-step the parameters are being updated. Call step() "
                "first, or build the optimizer with gradient_accumulation_steps=N to accumulate "
                "N backward passes")
        taken = []
        try:
            for c in chunks:
                self._use(c)
                taken.append(c)
        except BaseException:
            for c in taken:
                self._unuse(c)
            raise
        self._running.setdefault(id(module), []).append(taken)

    def _after_forward(self, chunks: list[int], module: Any, args: Any, output: Any) -> Any:
        calls = self._running.get(id(module))
        if not calls:  # Its pre-hook raised: nothing was taken.
            return None
        taken = calls.pop()
        output = self._detach_from_emptied(taken, output)
        for c in taken:
            self._unuse(c)
        if not torch.is_grad_enabled():
            return output
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, _Hook(self, "_before_backward", chunks), mode="any")
        return output

    def _detach_from_emptied(self, taken: list[int], output: Any) -> Any:
        """An output that views a parameter about to be emptied (a module returning
        ``self.weight[:n]``) is replaced by a copy (clone: autograd still reaches the
        parameter)."""
        emptied = {self._homes[i].untyped_storage().data_ptr()
                   for c in taken if self._uses[c] == 1 for i in self._members[c]}
        if not any(t.untyped_storage().data_ptr() in emptied for t in _tensors(output)):
            return output
        return _map_tensors(output, lambda t: t.clone()
                            if t.untyped_storage().data_ptr() in emptied else t)

    def _enter_backward(self, task: int) -> None:
        """A hook of ours runs in backward pass (graph task) `task`: its end gets a callback,
        and the first such pass is the outermost. A recompute's forward (activation
        checkpointing) runs in the pass around the region's own, so that one is seen first
        even when nothing hooks the model's output."""
        if task in self._callbacks_queued:
            return
        self._callbacks_queued.add(task)
        if self._outermost is None:
            self._outermost = task
        torch.autograd.Variable._execution_engine.queue_callback(
            _Hook(self, "_after_backward", task))

    def _before_backward(self, chunks: list[int], _grads: Any) -> None:
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "a backward pass with create_graph=True (a double backward: gradient penalties) "
                "is not built with offload_parameters: the second pass would read parameters "
                "the first one let go")
        task = torch._C._current_graph_task_id()
        self._enter_backward(task)
        for c in chunks:
            if self._backward_task[c] is not None:
                continue
            frozen = not self._members[c] or not self._trained[self._members[c][0]]
            if not frozen and self.handed[c] >= self.accumulation:
                raise RuntimeError(
                    f"a second backward pass reached chunk {c} in one micro-step: "
                    "offload_parameters hands each chunk's gradients to the engine once per "
                    "micro-step, and this step's are already there. Sum the losses and call "
                    "backward() once, or build the optimizer with gradient_accumulation_steps=N "
                    "for N backward passes per step()")
            with self._on_device():
                params, grads = self._engine.acquire(c)
            self._backward_task[c] = task
            self._take(c, params)
            if frozen:
                # Only the values are needed: the engine's copy may go at once.
                with self._on_device():
                    self._engine.release(c, self._stream())
                continue
            self._grad_buffer[c] = torch.from_dlpack(grads)
            self._waiting[c] = len(self._members[c])
            for i in self._members[c]:
                self._has_gradient[i] = False
                self._params[i]().grad = None

    def _on_gradient(self, i: int, p: torch.Tensor) -> None:
        c = self._chunk_of[i]
        if self._backward_task[c] is None or self._has_gradient[i]:
            raise RuntimeError(
                f"parameter {i} (shape {tuple(p.shape)}) received a gradient after its chunk "
                f"{c} went to the engine in this backward pass. offload_parameters hands a "
                "chunk over once all its parameters have their gradient; a parameter used inside "
                "and outside a torch.utils.checkpoint region with use_reentrant=True gets its "
                "gradient in two parts: use use_reentrant=False")
        offset, numel = self._place[i]
        self._grad_buffer[c][offset:offset + numel].copy_(p.grad.reshape(-1))
        # Until the next backward pass or zero_grad(), .grad says where the gradient went: a
        # clip_grad_norm_ of its own would otherwise skip it without a word.
        p.grad = self._gone[i]
        self._has_gradient[i] = True
        self._had_gradient[i] = True
        self._waiting[c] -= 1
        if self._waiting[c] == 0:
            self._hand_over(c)

    def _after_backward(self, task: int) -> None:
        """The end of the backward pass (graph task) `task`. Frozen chunks it took, and
        trained ones that got no gradient in it (torch.autograd.grad to the inputs), are let go.
        A trained chunk with some of its gradients waits for the outermost pass's end (under
        reentrant checkpointing each region's backward is a pass of its own, and a chunk may span
        two regions); there it goes to the engine with zeros for the parameters without one."""
        self._callbacks_queued.discard(task)
        for c, taken in enumerate(self._backward_task):
            if taken == task and (self._grad_buffer[c] is None
                                  or self._waiting[c] == len(self._members[c])):
                self._let_go(c)
        if task != self._outermost:
            return
        self._outermost = None
        partial = [c for c, taken in enumerate(self._backward_task) if taken is not None]
        self._keep_untouched([c for c in partial if self.handed[c] + 1 == self.accumulation])
        for c in partial:
            for i in self._members[c]:
                if not self._has_gradient[i]:
                    offset, numel = self._place[i]
                    self._grad_buffer[c][offset:offset + numel].zero_()
            self._hand_over(c)

    def _hand_over(self, c: int) -> None:
        optimizer = self._optimizer()
        if optimizer is not None and not optimizer._this_step.open:
            optimizer._begin_step()
        stream = self._stream()
        with self._on_device():
            try:
                self._engine.grads_ready(c, stream)
            finally:
                self._engine.release(c, stream)
        self.handed[c] += 1
        self._backward_task[c] = None
        self._grad_buffer[c] = None
        self._unuse(c)

    def _let_go(self, c: int) -> None:
        """Ends backward's hold on chunk `c` without handing its gradients over."""
        if self._grad_buffer[c] is not None:  # Trained: the engine's copy is still acquired.
            with self._on_device():
                self._engine.release(c, self._stream())
        self._backward_task[c] = None
        self._grad_buffer[c] = None
        self._unuse(c)

    # ------------------------------------------------------------------ filling and emptying

    def _use(self, c: int) -> None:
        """A forward call's use: the engine's copy is needed only to fill the parameters."""
        if self._uses[c] > 0:
            self._uses[c] += 1
            return
        with self._on_device():
            params, _ = self._engine.acquire(c)
            try:
                self._take(c, params)
            finally:
                self._engine.release(c, self._stream())

    def _take(self, c: int, params_view: Any) -> None:
        """One more use of chunk `c`, whose engine copy `params_view` is acquired: the first
        fills its parameters' storages from it."""
        if self._uses[c] == 0:
            chunk = torch.from_dlpack(params_view)
            with torch.no_grad():
                for i in self._members[c]:
                    offset, numel = self._place[i]
                    home = self._homes[i]
                    home.untyped_storage().resize_(numel * home.element_size())
                    home.copy_(chunk[offset:offset + numel].view(self._shapes[i]))
                    p = self._params[i]()
                    if p is not None:
                        p.data = home
            self.filled_bytes += self._bytes_of[c]
            self.peak_filled_bytes = max(self.peak_filled_bytes, self.filled_bytes)
        self._uses[c] += 1

    def _unuse(self, c: int) -> None:
        self._uses[c] -= 1
        if self._uses[c] > 0:
            return
        for i in self._members[c]:
            p = self._params[i]()
            if p is not None and i not in self._session:
                p.data = self._absent[i]
            self._homes[i].untyped_storage().resize_(0)
        self.filled_bytes -= self._bytes_of[c]

    def _stream(self) -> int:
        return _device.trainer_stream(self._device)

    def _on_device(self) -> Any:
        return _device.selected(self._device)

    # ---------------------------------------------------------------- model.state_dict()

    def _masters(self, indices: list[int]) -> list[torch.Tensor]:
        out = [torch.empty(self._place[i][1], dtype=torch.float32) for i in indices]
        with self._on_device():
            self._engine.read_states([(i, MASTER, o.numpy()) for i, o in zip(indices, out)])
        return out

    def _lend(self, own: list[int]) -> None:
        """Gives `own`'s parameters memory of their own holding their values, for one module's
        part of a state_dict or load_state_dict call. The call is a session from its outermost
        module's pre-hook to its post-hook (a parent's runs before its children's hooks and
        after them): a parameter lent once in it keeps its tensor to the end, so tied weights
        share one. A parameter filled for a module running now (a state_dict taken inside a
        forward) is read where it is."""
        self._session_depth += 1
        fresh = []
        for i in own:
            if i in self._session or i in self._session_in_use:
                continue
            if self._uses[self._chunk_of[i]] > 0:
                self._session_in_use[i] = None
            else:
                fresh.append(i)
        for i, value in zip(fresh, self._masters(fresh)):
            self._params[i]().data = value.to(self._device, self._dtype).view(self._shapes[i])
            self._session[i] = None

    def _end_session(self) -> tuple[list[int], list[int]]:
        """One module's part is done; at the session's end, the parameters it lent (to be
        given their stand-ins back by the caller) and those it read where they were filled."""
        self._session_depth -= 1
        if self._session_depth > 0:
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
        for name, p in module._parameters.items():
            i = self._index.get(id(p)) if p is not None else None
            key = prefix + name
            if (i is not None and i in self._session_in_use and key in state_dict
                    and state_dict[key] is not p):
                state_dict[key] = state_dict[key].clone()
        lent, _ = self._end_session()
        for i in lent:
            self._params[i]().data = self._absent[i]

    def _before_load(self, own: list[int], module: Any, *args: Any) -> None:
        self._lend(own)

    def _after_load(self, own: list[int], module: Any, incompatible_keys: Any) -> None:
        lent, in_use = self._end_session()
        done = lent + in_use
        if not done:
            return
        optimizer = self._optimizer()
        values = [self._params[i]().detach().reshape(-1).to("cpu", torch.float32)
                  for i in done]
        if self._dtype != torch.float32:
            # A value that rounds from its master keeps the master's fp32 bits (a save and
            # load of the same model keeps training exactly).
            masters = self._masters(done)
            values = [torch.where(m.to(self._dtype).float() == v, m, v)
                      for m, v in zip(masters, values)]
        try:
            optimizer._write_states([(i, MASTER, v, "the loaded value")
                                     for i, v in zip(done, values)])
        finally:
            for i in lent:
                self._params[i]().data = self._absent[i]


class _Hook:
    """A hook that holds its residency weakly, so that hooks left on a model keep nothing
    alive; `method` is called with `bound` first."""

    def __init__(self, residency: ParameterResidency, method: str, bound: Any) -> None:
        self._residency = weakref.ref(residency)
        self._method = method
        self._bound = bound

    def __call__(self, *args: Any) -> Any:
        residency = self._residency()
        if residency is not None:
            return getattr(residency, self._method)(self._bound, *args)
        return None


def _map_tensors(output: Any, fn: Any) -> Any:
    """`output` with `fn` applied to each tensor in it: in pytree's containers (HF's
    ModelOutput registers itself) and dataclasses' fields."""
    leaves, spec = pytree.tree_flatten(output)
    mapped = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = fn(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = {f.name: _map_tensors(getattr(leaf, f.name), fn)
                      for f in dataclasses.fields(leaf) if f.init}
            if any(v is not getattr(leaf, k) for k, v in fields.items()):
                leaf = dataclasses.replace(leaf, **fields)
        mapped.append(leaf)
    return pytree.tree_unflatten(mapped, spec)


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (as _map_tensors finds them)."""
    found: list[torch.Tensor] = []
    _map_tensors(output, lambda t: found.append(t) or t)
    return found


def _unreadable(like: torch.Tensor, message: str) -> torch.Tensor:
    """A tensor of `like`'s shape, dtype and device without storage, whose every read raises
    `message` (torch's own mechanism for storage-less tensors: an access would read nothing)."""
    t = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    t.untyped_storage().resize_(0)
    torch._C._set_storage_access_error_msg(t, message)
    return t


def place(options: dict[str, Any], plan: OffloadPlan, accumulation: int) -> None:
    """The engine's config (engine_options') for offloaded parameters: their home, the device
    budget, and the engine summing `accumulation` micro-steps (the parameters' gradient buffers
    do not outlive a backward pass, so torch cannot accumulate in .grad)."""
    placement = options["placement"]
    placement["params"] = plan.tier
    optimizer = options["optimizer"]
    optimizer["gradient_accumulation_steps"] = accumulation
    # The recheck reads gradient buffers that stay where the trainer keeps them; offloaded
    # chunks' leave the device with each backward pass. Gradients go over when final instead.
    optimizer["recheck_gradients"] = False
    if plan.tier == "nvme":
        paths = options.setdefault("nvme", {}).setdefault("paths", [plan.nvme_path])
        if plan.nvme_path not in paths:
            raise ValueError(
                f"offload_parameters' nvme_path {plan.nvme_path!r} differs from the optimizer's "
                f"{paths}: the engine keeps one set of NVMe paths; give both the same")
    if plan.device_memory is not None:
        key = "cuda_memory_bytes" if options["device"]["kind"] == "cuda" else \
            "host_device_memory_bytes"
        options["device"][key] = plan.device_memory
