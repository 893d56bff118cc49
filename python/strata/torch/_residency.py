"""ParameterResidency: the module hooks that put offloaded parameters (offload_parameters) on
the device while a module that owns them runs, forward or backward.

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
  to the engine (GradsReady: its update may start at once) and is let go. A frozen chunk is let
  go at the end of the backward pass that took it.

``model.state_dict()`` and ``load_state_dict`` see real values (_model_state_dict.py). The
step's facts (micro-steps handed over per chunk, which parameters had a gradient) are the step
body's StepState; what is here lives for one forward or backward pass. Everything runs on the
trainer's thread (or autograd's, one hook at a time).
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

from strata import _log
from strata.torch._model_state_dict import ModelStateDictSessions
from strata.torch._module_hooks import WeakHook, map_tensors, tensors_in
from strata.torch._native import MASTER

if TYPE_CHECKING:
    from strata.torch._layout import Layout
    from strata.torch._native import NativeEngine
    from strata.torch._params import ParamTable
    from strata.torch._step import StepBody


class ParameterResidency:
    """One per optimizer. It holds no reference to its optimizer, so that the optimizer's
    finalizer (remove) can run."""

    def __init__(self, model: torch.nn.Module, native: NativeEngine, table: ParamTable,
                 body: StepBody, layout: Layout, accumulation: int) -> None:
        self.native = native
        # Both hold this residency (through the layout): held weakly, so that nothing of an
        # optimizer is a cycle and its engine goes with its last reference.
        self._body = weakref.proxy(body)
        self._layout = weakref.proxy(layout)  # Writes masters (its state batch checks sizes).
        self.accumulation = accumulation
        params = table.params
        self.params = [weakref.ref(p) for p in params]
        self.shapes = [p.shape for p in params]
        self.dtype = table.dtype
        self.device = table.device
        self._records = table.records
        self._members = table.in_chunk  # Every parameter of each chunk, frozen ones too.
        chunk_count = native.chunk_count
        # Each parameter's own storage, full while in use and empty between uses, and the
        # stand-in .data points at then.
        self._homes: list[torch.Tensor] = []
        self.absent: list[torch.Tensor] = []
        self._gone: list[torch.Tensor] = []  # What .grad holds once handed to the engine.
        for i, p in enumerate(params):
            home = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            home.untyped_storage().resize_(0)
            self._homes.append(home)
            self.absent.append(_unreadable(
                p, f"parameter {i} (shape {tuple(p.shape)}) is offloaded by "
                "strata.torch.offload_parameters and is on the device only while a module that "
                "owns it runs: read it inside that module's forward, or through "
                "model.state_dict()"))
            self._gone.append(_unreadable(
                p, f"the gradient of parameter {i} (shape {tuple(p.shape)}) went to the engine "
                "during backward (strata.torch.offload_parameters): clip with the optimizer's "
                "max_grad_norm (DeepSpeed's gradient_clipping) and read the norm from "
                "opt.last_step['grad_norm']"))
            p.data = self.absent[i]
            p.grad = None
        self._bytes_of = [sum(self._records[i].numel for i in m) * params[0].element_size()
                          for m in self._members]
        # Reasons each chunk's parameters are filled: forward calls running, and one for
        # backward's hold.
        self.uses = [0] * chunk_count
        # Backward's hold: the graph task that took it, per chunk (None = not held).
        self._backward_task: list[int | None] = [None] * chunk_count
        self._grad_buffer: list[torch.Tensor | None] = [None] * chunk_count
        # Per trained chunk, this backward: parameters still without their gradient.
        self._waiting = [0] * chunk_count
        self._has_gradient = [False] * len(params)
        # Graph tasks whose end-of-backward callback is queued, and the first of them: the
        # outermost backward pass (reentrant checkpointing runs nested ones inside it).
        self._callbacks_queued: set[int] = set()
        self._outermost: int | None = None
        # The chunks each module's forward calls running took, innermost call last.
        self._running: dict[int, list[list[int]]] = {}
        self.filled_bytes = 0
        self.peak_filled_bytes = 0
        self.index = {id(p): i for i, p in enumerate(params)}
        self.sessions = ModelStateDictSessions(self)
        self._hooks = self._install(model)
        left_out = [p for p in model.parameters() if id(p) not in self.index]
        if left_out:
            mib = sum(p.numel() * p.element_size() for p in left_out) / 2**20
            warnings.warn(
                f"{len(left_out)} parameters of the offloaded model ({mib:.1f} MiB) are not in "
                f"the optimizer and stay on the device: build the optimizer over "
                "model.parameters() (frozen ones included: they stay frozen) to offload them too",
                _log.StrataWarning, stacklevel=5)

    # ------------------------------------------------------------------ what the step uses

    def chunk_of(self, i: int) -> int:
        return self._records[i].chunk

    def read_masters(self, indices: list[int]) -> list[torch.Tensor]:
        # Through the engine, which this residency holds: remove() runs as the optimizer's
        # finalizer, and when the optimizer was in a reference cycle the collector may have
        # cleared the layout and the body (held here weakly) first.
        return self.native.read_states([(i, MASTER, self._records[i].numel) for i in indices])

    def write_masters(self, indices: list[int], values: list[torch.Tensor]) -> None:
        self._layout.write_states([(i, MASTER, v, "the loaded value")
                                   for i, v in zip(indices, values)])

    def keep_untouched(self, last: list[int]) -> None:
        """Before the last hand-over of chunks `last`: the states of their parameters without
        a gradient in this whole step, which the engine updates with zeros and torch leaves
        alone, are saved to be put back after the step."""
        counts = self._body.state.counts
        never = [i for c in last for i in self._members[c] if not counts[i]]
        if never:
            self._body.save_untouched(never)

    def clear_gradients(self) -> None:
        """zero_grad(): .grad is None (what it held went to the engine)."""
        self.after_interruption()
        for ref in self.params:
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
                    self.unuse(c)
        self._running.clear()
        for c, task in enumerate(self._backward_task):
            if task is not None:
                self._let_go(c)
        self._callbacks_queued.clear()
        self._outermost = None
        self.sessions.interrupted()

    def remove(self) -> None:
        """Gives every parameter memory of its own with its current value (the engine's
        master) and removes the hooks: the model is plain torch again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        indices = [i for i, ref in enumerate(self.params) if ref() is not None]
        if not indices:
            return
        try:
            values = self.read_masters(indices)
        except RuntimeError as e:
            # Collected mid-step (the loop stopped between backward and step()): the values
            # are being updated and cannot be read; the parameters stay unreadable.
            warnings.warn(f"the parameters offloaded by a collected optimizer keep no values: {e}",
                          _log.StrataWarning, stacklevel=2)
            return
        with torch.no_grad():
            for i, value in zip(indices, values):
                p = self.params[i]()
                p.data = value.to(self.device, self.dtype).view(self.shapes[i])
                if p.grad is self._gone[i]:
                    p.grad = None

    # --------------------------------------------------------------------------- the hooks

    def _install(self, model: torch.nn.Module) -> list[Any]:
        handles = [model.register_forward_pre_hook(WeakHook(self, "_at_model_forward", None),
                                                   prepend=True),
                   model.register_forward_hook(WeakHook(self, "_after_model_forward", None))]
        for module in model.modules():
            own = sorted({self.index[id(p)] for p in module._parameters.values()
                          if p is not None and id(p) in self.index})
            if own:
                chunks = sorted({self.chunk_of(i) for i in own})
                handles.append(module.register_forward_pre_hook(
                    WeakHook(self, "_before_forward", chunks)))
                # always_call: a forward that raises lets go of what it took too (non-reentrant
                # checkpointing stops each recompute with an exception once it has what it
                # needs).
                handles.append(module.register_forward_hook(
                    WeakHook(self, "_after_forward", chunks), always_call=True))
            elif module is not model:
                continue
            # The model's own hooks, with or without parameters of its own, make a state_dict
            # call one session (tied weights lent once).
            handles += self.sessions.install(module, own)
        for i, ref in enumerate(self.params):
            if self._records[i].trained:
                handles.append(ref().register_post_accumulate_grad_hook(
                    WeakHook(self, "_on_gradient", i)))
        return handles

    def _at_model_forward(self, _: None, module: Any, args: Any) -> None:
        """The model's own forward starts: nothing of ours can be running unless a pass was
        interrupted (then it is let go of)."""
        self.after_interruption()

    def _after_model_forward(self, _: None, module: Any, args: Any, output: Any) -> None:
        """Hooks the model's outputs so that the outermost backward pass is the first to
        reach a hook of ours (see _after_backward)."""
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(
                tensors, WeakHook(self, "_before_backward", []), mode="any")

    def _before_forward(self, chunks: list[int], module: Any, args: Any) -> None:
        task = torch._C._current_graph_task_id()
        passes = self._body.state.backward_passes()
        if task != -1:  # A recompute inside backward.
            self._enter_backward(task)
        elif passes >= self.accumulation:
            raise RuntimeError(
                f"the model runs again after {passes} backward passes without "
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
                self.unuse(c)
            raise
        self._running.setdefault(id(module), []).append(taken)

    def _after_forward(self, chunks: list[int], module: Any, args: Any, output: Any) -> Any:
        calls = self._running.get(id(module))
        if not calls:  # Its pre-hook raised: nothing was taken.
            return None
        taken = calls.pop()
        output = self._detach_from_emptied(taken, output)
        for c in taken:
            self.unuse(c)
        if not torch.is_grad_enabled():
            return output
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, WeakHook(self, "_before_backward", chunks), mode="any")
        return output

    def _detach_from_emptied(self, taken: list[int], output: Any) -> Any:
        """An output that views a parameter about to be emptied (a module returning
        ``self.weight[:n]``) is replaced by a copy (clone: autograd still reaches the
        parameter)."""
        emptied = {self._homes[i].untyped_storage().data_ptr()
                   for c in taken if self.uses[c] == 1 for i in self._members[c]}
        if not any(t.untyped_storage().data_ptr() in emptied for t in tensors_in(output)):
            return output
        return map_tensors(output, lambda t: t.clone()
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
            WeakHook(self, "_after_backward", task))

    def _before_backward(self, chunks: list[int], _grads: Any) -> None:
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "a backward pass with create_graph=True (a double backward: gradient penalties) "
                "is not built with offload_parameters: the second pass would read parameters "
                "the first one let go")
        task = torch._C._current_graph_task_id()
        self._enter_backward(task)
        handed = self._body.state.handed
        for c in chunks:
            if self._backward_task[c] is not None:
                continue
            frozen = not self._members[c] or not self._records[self._members[c][0]].trained
            if not frozen and handed[c] >= self.accumulation:
                raise RuntimeError(
                    f"a second backward pass reached chunk {c} in one micro-step: "
                    "offload_parameters hands each chunk's gradients to the engine once per "
                    "micro-step, and this step's are already there. Sum the losses and call "
                    "backward() once, or build the optimizer with gradient_accumulation_steps=N "
                    "for N backward passes per step()")
            params, grads = self.native.acquire(c)
            self._backward_task[c] = task
            self._take(c, params)
            if frozen:
                # Only the values are needed: the engine's copy may go at once.
                self.native.release(c)
                continue
            self._grad_buffer[c] = grads
            self._waiting[c] = len(self._members[c])
            for i in self._members[c]:
                self._has_gradient[i] = False
                self.params[i]().grad = None

    def _on_gradient(self, i: int, p: torch.Tensor) -> None:
        c = self.chunk_of(i)
        if self._backward_task[c] is None or self._has_gradient[i]:
            raise RuntimeError(
                f"parameter {i} (shape {tuple(p.shape)}) received a gradient after its chunk "
                f"{c} went to the engine in this backward pass. offload_parameters hands a "
                "chunk over once all its parameters have their gradient; a parameter used inside "
                "and outside a torch.utils.checkpoint region with use_reentrant=True gets its "
                "gradient in two parts: use use_reentrant=False")
        r = self._records[i]
        self._grad_buffer[c][r.offset:r.offset + r.numel].copy_(p.grad.reshape(-1))
        # Until the next backward pass or zero_grad(), .grad says where the gradient went: a
        # clip_grad_norm_ of its own would otherwise skip it without a word.
        p.grad = self._gone[i]
        self._has_gradient[i] = True
        self._body.state.counts[i] += 1
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
        handed = self._body.state.handed
        self.keep_untouched([c for c in partial if handed[c] + 1 == self.accumulation])
        for c in partial:
            for i in self._members[c]:
                if not self._has_gradient[i]:
                    r = self._records[i]
                    self._grad_buffer[c][r.offset:r.offset + r.numel].zero_()
            self._hand_over(c)

    def _hand_over(self, c: int) -> None:
        if not self._body.state.open:
            self._body.begin()
        self.native.hand_over(c, acquired=True)
        self._body.state.handed[c] += 1
        self._backward_task[c] = None
        self._grad_buffer[c] = None
        self.unuse(c)

    def _let_go(self, c: int) -> None:
        """Ends backward's hold on chunk `c` without handing its gradients over."""
        if self._grad_buffer[c] is not None:  # Trained: the engine's copy is still acquired.
            self.native.release(c)
        self._backward_task[c] = None
        self._grad_buffer[c] = None
        self.unuse(c)

    # ------------------------------------------------------------------ filling and emptying

    def _use(self, c: int) -> None:
        """A forward call's use: the engine's copy is needed only to fill the parameters."""
        if self.uses[c] > 0:
            self.uses[c] += 1
            return
        params, _ = self.native.acquire(c)
        try:
            self._take(c, params)
        finally:
            self.native.release(c)

    def _take(self, c: int, chunk: torch.Tensor) -> None:
        """One more use of chunk `c`, whose engine copy `chunk` is acquired: the first fills
        its parameters' storages from it."""
        if self.uses[c] == 0:
            with torch.no_grad():
                for i in self._members[c]:
                    r, home = self._records[i], self._homes[i]
                    home.untyped_storage().resize_(r.numel * home.element_size())
                    home.copy_(chunk[r.offset:r.offset + r.numel].view(self.shapes[i]))
                    p = self.params[i]()
                    if p is not None:
                        p.data = home
            self.filled_bytes += self._bytes_of[c]
            self.peak_filled_bytes = max(self.peak_filled_bytes, self.filled_bytes)
        self.uses[c] += 1

    def unuse(self, c: int) -> None:
        self.uses[c] -= 1
        if self.uses[c] > 0:
            return
        for i in self._members[c]:
            p = self.params[i]()
            if p is not None and not self.sessions.lent(i):
                p.data = self.absent[i]
            self._homes[i].untyped_storage().resize_(0)
        self.filled_bytes -= self._bytes_of[c]


def _unreadable(like: torch.Tensor, message: str) -> torch.Tensor:
    """A tensor of `like`'s shape, dtype and device without storage, whose every read raises
    `message` (torch's own mechanism for storage-less tensors: an access would read nothing)."""
    t = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    t.untyped_storage().resize_(0)
    torch._C._set_storage_access_error_msg(t, message)
    return t
