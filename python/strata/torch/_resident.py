"""Resident parameters: each parameter's ``.data`` is a view into its chunk's device memory (as
FSDP's FlatParameter), which stays put for the engine's life, so the model, its hooks and
``model.state_dict()`` keep working on the same ``Parameter`` objects.

A post-accumulate-grad hook on every trained parameter counts backward passes. On the last
micro-step of a step (``gradient_accumulation_steps``, or with "auto" the most backward passes a
step has had so far; the first step, which has no such count yet, hands everything over in
step()), the parameter's gradient is placed in its chunk's gradient buffer (``.grad`` becomes a
view of it; when autograd already accumulated into that view nothing is copied), and once every
parameter of a chunk has its gradient the chunk is handed to the engine, whose CPU update starts
while backward goes on. ``step()`` hands over the chunks still waiting.

An update made during backward is speculative: on CPU tensors the engine reads every chunk's
gradients again at ``step()`` (``rechecks``: a checksum taken as it first measured them), and a
chunk whose gradients the trainer changed meanwhile (``clip_grad_norm_`` that clips,
``GradScaler``'s unscale, an edit through ``.data``, a replaced ``.grad``) is rolled back and
updated again from them. On a GPU that recheck is not built yet, and a change the version
counters see raises instead.

Parameters written in place between steps (``model.load_state_dict``, an in-place init under
``no_grad``) become their masters at the next step's first gradient (adopt_parameter_changes).
The mirrored layouts (_mirrored.py) are this one with the parameters' parts copied in and out.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from strata.torch import _lifetime
from strata.torch._layout import Layout, Prepared
from strata.torch._native import MASTER
from strata.torch._options import rechecks_gradients
from strata.torch._params import flat_fp32, keep_master_bits

if TYPE_CHECKING:
    from strata.torch._native import NativeEngine
    from strata.torch._params import ParamTable
    from strata.torch._step import StepBody
    from strata.torch._step_state import StepState


class Resident(Layout):
    mirrors = False
    # Said when a step comes after a number of backward passes other than the one given.
    _backward_count_hint = ""

    def __init__(self, params: list[torch.Tensor], *, gradient_accumulation_steps: int | str,
                 overlap: bool) -> None:
        super().__init__(params)
        self.rechecks = rechecks_gradients(params[0].device)
        self._gas = gradient_accumulation_steps
        # The backward passes after which a chunk's gradients are complete, so that it can be
        # handed to the engine during backward: the count given, or with "auto" the most a
        # step has had (None before the first step). A framework that accumulates then needs
        # no second declaration, and a shorter window (an epoch's last batches) hands
        # everything over in step(), after its last backward.
        self._rhythm: int | None = None if gradient_accumulation_steps == "auto" else (
            gradient_accumulation_steps)
        # False: every chunk goes to the engine in step(), after backward.
        self._overlap = overlap
        self._body: StepBody | None = None
        self._chunk_grads: list[torch.Tensor | None] = []

    def attach(self, native: NativeEngine, table: ParamTable, body: StepBody) -> list[Any]:
        super().attach(native, table, body)
        self._body = weakref.proxy(body)  # The body holds this layout: no cycle.
        chunk_params = []
        for c in range(native.chunk_count):
            params, grads = native.chunk_memory(c)
            chunk_params.append(params)
            self._chunk_grads.append(grads)
        hooks = []
        for r, p in zip(table.records, table.params):
            mine = self.local(r.index, p)
            r.view = chunk_params[r.chunk][r.offset : r.offset + mine.numel()].view(mine.shape)
            self._adopt_view(p, r.view)
            if r.trained:
                r.grad_view = self._chunk_grads[r.chunk][
                    r.offset : r.offset + mine.numel()].view(mine.shape)
                hooks.append(p.register_post_accumulate_grad_hook(_GradHook(self, r.index)))
        self.mark_versions()
        storages = {t.untyped_storage().data_ptr()
                    for t in chunk_params + [g for g in self._chunk_grads if g is not None]}
        return [_lifetime.detach, [weakref.ref(p) for p in table.params], hooks, storages]

    def _adopt_view(self, p: torch.Tensor, view: torch.Tensor) -> None:
        """The parameter's memory becomes its place in the chunk."""
        p.data = view

    # ---------------------------------------------------------------------- backward

    def on_gradient(self, i: int) -> None:
        """Parameter i's post-accumulate-grad hook: one more backward pass reached it. Checks
        come before any count changes, so an error leaves the step as it was."""
        body, p = self._body, self._params[i]
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(
                f"{body.owner} does not support sparse gradients (parameter {i}, shape "
                f"{tuple(p.shape)}); use nn.Embedding(sparse=False)")
        if body.retry_pending:
            body.check_open("backward()")
        if not body.state.open:
            body.begin()
        step, gas, chunk = body.state, self._gas, self.table.chunk_of(i)
        if self.rechecks and (step.handed[chunk] or
                              (step.placed[i] and not self._holds_placed_gradient(i))):
            # A backward after this chunk was handed over without step() between (a window
            # longer than any before, with "auto"), or after this parameter's placed gradient
            # was set to None or replaced (a step the loop skipped with model.zero_grad()): the
            # engine drops what it did, if anything, and gradients the loop discarded count
            # afresh; step() hands over again.
            if step.handed_chunks():
                body.take_back()
            step = body.state
            step.restart([j for j in range(len(self._params))
                          if step.placed[j] and not self._holds_placed_gradient(j)],
                         self.table.members)
        if gas == "auto" and step.handed[chunk]:
            raise RuntimeError(
                f"parameter {i} (shape {tuple(p.shape)}) received its gradient "
                f"{step.counts[i] + 1} times since the last step(), more than the "
                f"{self._rhythm} backward passes of any step before, and chunk {chunk}'s update "
                f"had already started with {self._rhythm} passes' gradients (the update "
                "overlaps backward), so this step's update of it is partial. With "
                "gradient_accumulation_steps='auto' the number of backward passes per step() may "
                "shrink but not grow: pass gradient_accumulation_steps=N (the most backward "
                "passes per step(); the HF Trainer's gradient_accumulation_steps, Lightning's "
                "accumulate_grad_batches) or overlap=False. " + self._hooks_hint())
        if gas != "auto" and step.counts[i] + 1 > gas:
            raise RuntimeError(
                f"parameter {i} (shape {tuple(p.shape)}) received its gradient "
                f"{step.counts[i] + 1} times since the last step(), but this optimizer was "
                f"built with gradient_accumulation_steps={gas}: call step() after every {gas} "
                "backward(), one backward per micro-batch, or leave gradient_accumulation_steps "
                "at its default, 'auto', to follow the trainer's (the HF Trainer's "
                "gradient_accumulation_steps, Lightning's accumulate_grad_batches). "
                "torch.utils.checkpoint with use_reentrant=True runs a parameter's gradient hook "
                "twice: use use_reentrant=False. " + self._hooks_hint())
        step.counts[i] += 1
        # A parameter past the rhythm ("auto", a longer window) was placed at the rhythm and
        # goes on accumulating in its chunk's buffer until the chunk is handed over.
        if step.counts[i] != self._rhythm or not self._overlap:
            return
        self._place_gradient(i)
        step.waiting[chunk] -= 1
        if step.waiting[chunk] == 0:
            self._submit(chunk)

    def _hooks_hint(self) -> str:
        owner = self._body.owner
        return (f"If another optimizer trains these parameters now, this {owner} is still alive "
                "(an LR scheduler or a framework holds it) and still hooked to them: call its "
                "close() first")

    def _place_gradient(self, i: int) -> None:
        """Puts parameter i's accumulated gradient into its chunk's gradient buffer and makes
        ``.grad`` a view of it (a no-op when autograd accumulated into that view). A parameter
        without a gradient gets zeros there and keeps ``.grad`` None."""
        p, r = self._params[i], self.table.records[i]
        if p.grad is None:
            r.grad_view.zero_()
        else:
            self._copy_gradient(i, p, r.grad_view)
        step = self._body.state
        step.placed[i] = True
        step.placed_version[r.chunk] = self._chunk_grads[r.chunk]._version

    def _copy_gradient(self, i: int, p: torch.Tensor, view: torch.Tensor) -> None:
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    def _holds_placed_gradient(self, i: int) -> bool:
        """Whether parameter i's ``.grad`` is still the gradient _place_gradient placed (not
        set to None or replaced since): its chunk's buffer."""
        return self._params[i].grad is self.table.records[i].grad_view

    def _submit(self, chunk: int) -> None:
        self.native.hand_over(chunk)
        step = self._body.state
        step.handed[chunk] = 1
        step.placed_version[chunk] = self._chunk_grads[chunk]._version

    # ------------------------------------------------------------------------ step()

    def prepare_step(self, state: StepState) -> Prepared:
        self._check_backward_count(state)
        state.grad_norm = self.grad_norm()
        modified = None
        if self.rechecks:
            self._sync_handed_gradients()
        else:
            modified = self._gradients_modified_after_backward()
        self._hand_over_the_rest()
        state = self._body.state  # _sync_handed_gradients may have taken the step back.
        if not state.handed_chunks():
            # Every .grad was set to None after backward (model.zero_grad()): torch skips
            # every parameter, and so does this step.
            return Prepared(proceed=False)
        if modified:
            modified = (
                f"the gradients of {modified} changed between backward() and step() (by "
                "torch.nn.utils.clip_grad_norm_, say) after the engine had taken them, so this "
                "step used them as they were before, after or during the change (the engine "
                "reads them where backward put them, as its updates run). Pass max_grad_norm=... "
                f"to {self._body.owner} to clip on the global norm, and read the norm from "
                "opt.last_step['grad_norm'] instead of computing it")
        return Prepared(deferred_error=modified)

    def grad_norm(self) -> float | None:
        """Mirrored: the gradients' 2-norm over the whole model, clipping them in place. None:
        the engine measures and clips."""
        return None

    def _check_backward_count(self, state: StepState) -> None:
        most = max(state.counts, default=0)
        if most == 0:
            raise RuntimeError(
                "step() before any backward(): no parameter received a gradient since the last "
                "step()")
        gas = self._gas
        if gas != "auto" and most != gas:
            raise RuntimeError(
                f"step() after {most} backward passes, but this optimizer was built with "
                f"gradient_accumulation_steps={gas}: call step() after every {gas} backward(), "
                "or zero_grad() to discard the partial accumulation, or leave "
                "gradient_accumulation_steps at its default, 'auto', which takes what comes "
                "(the HF Trainer's short last window at an epoch's end)"
                + self._backward_count_hint)

    def step_completed(self, state: StepState) -> None:
        """With "auto": the rhythm becomes the most backward passes a step has had."""
        if self._gas == "auto":
            self._rhythm = max(self._rhythm or 0, max(state.counts, default=0)) or None

    def _hand_over_the_rest(self) -> None:
        """Hands the engine every chunk that got a gradient and is not with it yet. A
        parameter without a gradient in such a chunk is updated with zeros by the engine; torch
        leaves it alone (one whose .grad is None; a zeroed .grad is a gradient), so its states
        are saved and put back after the step, and its .grad stays None. Torch's per-parameter
        step count has no equivalent: the chunk's advances."""
        def has_gradient(i: int) -> bool:
            return self._params[i].grad is not None

        state, members = self._body.state, self.table.members
        chunks = [c for c, m in enumerate(members)
                  if not state.handed[c] and any(has_gradient(i) for i in m)]
        self._body.save_untouched([i for c in chunks for i in members[c]
                                   if not has_gradient(i)])
        for c in chunks:
            for i in members[c]:
                # Placed before too, when .grad was replaced since (nothing to copy otherwise).
                self._place_gradient(i)
            self._submit(c)

    def _sync_handed_gradients(self) -> None:
        """Rechecking, at step(): a handed-over parameter whose ``.grad`` the trainer replaced
        gets the new one copied into its chunk's buffer, where the engine's recheck sees it.
        One whose ``.grad`` became None is skipped by torch, which a chunk already with the
        engine cannot do: the engine drops this step and every chunk goes again
        (_hand_over_the_rest keeps such parameters' states as they were)."""
        handed = [i for c in self._body.state.handed_chunks() for i in self.table.members[c]]
        if any(self._params[i].grad is None for i in handed):
            self._body.take_back()
            return
        for i in handed:
            # A mirrored parameter's gradient is FSDP2's or DDP's, copied in: copied again.
            if self._params[i].grad is not self.table.records[i].grad_view:
                self._place_gradient(i)

    def _gradients_modified_after_backward(self) -> str | None:
        """Which parameters' gradients changed (or were replaced) after the engine took them."""
        changed = []
        state = self._body.state
        for chunk, members in enumerate(self.table.members):
            if not state.handed[chunk]:
                continue
            if self._chunk_grads[chunk]._version != state.placed_version[chunk]:
                changed.append(f"chunk {chunk}'s parameters {members[0]}..{members[-1]}")
                continue
            for i in members:
                if (state.counts[i] > 0
                        and self._params[i].grad is not self.table.records[i].grad_view):
                    changed.append(f"parameter {i}")
        return ", ".join(changed) if changed else None

    def zero_grad(self, state: StepState) -> bool:
        """torch's zero_grad. After a backward whose gradients no chunk has taken yet, it also
        discards that backward (a skipped batch); once chunks were handed to the engine the step
        can only be finished, by step(), unless the engine can take them back."""
        if state.open:
            self._body.discard()
        return True

    # --------------------------------------------------------- parameters written in place

    def begin_step(self, state: StepState) -> None:
        self.adopt_parameter_changes()

    def adopt_parameter_changes(self, everything: bool = False) -> None:
        """Parameters written in place since the engine last set them (model.load_state_dict,
        an in-place init under no_grad; every parameter with `everything`) become their
        masters where they differ from the master rounded to the working dtype, so a write of
        the same values (an EMA swap and back) keeps the fp32 masters. A parameter whose
        ``.data`` was replaced is copied in and pointed back at its chunk."""
        self._refuse_cast_or_moved()
        changed = {}
        for r, p in zip(self.table.records, self._params):
            replaced = self._replaced(p, r.view)
            if everything or replaced or self.local(r.index, p)._version != r.version:
                changed[r.index] = (flat_fp32(self.local(r.index, p), copy=True), replaced)
        # Every new value is read before any is written: writing one master rewrites the working
        # values of its whole chunk from the masters, undoing the others' in-place changes.
        if changed and self.table.dtype != torch.float32:
            masters = self.read_states([(i, MASTER) for i in changed])
            kept = keep_master_bits(masters, [v for v, _ in changed.values()], self.table.dtype)
            changed = {i: (v, replaced) for (i, (_, replaced)), v in zip(changed.items(), kept)}
        self.write_states([(i, MASTER, values, "the parameter's new value")
                           for i, (values, _) in changed.items()])
        for i, (_, replaced) in changed.items():
            if replaced:
                self._params[i].data = self.table.records[i].view
        self.mark_versions()

    def _replaced(self, p: torch.Tensor, view: torch.Tensor) -> bool:
        """Whether the parameter's ``.data`` no longer is its place in the chunk."""
        return p.data_ptr() != view.data_ptr()

    def mark_versions(self) -> None:
        for r, p in zip(self.table.records, self._params):
            r.version = self.local(r.index, p)._version

    def _refuse_cast_or_moved(self) -> None:
        """A model cast (``model.to(torch.bfloat16)``) or moved (``model.to("cuda")``) after the
        optimizer was built: its parameters no longer live in the engine's chunks, and copying
        their values back would silently undo the cast. Refused before anything changes."""
        dtype, device, owner = self.table.dtype, self.table.device, self._body.owner
        for i, p in enumerate(self._params):
            if p.dtype != dtype or p.device != device:
                raise RuntimeError(
                    f"parameter {i} (shape {tuple(p.shape)}) is now {p.dtype} on {p.device}, "
                    f"but {owner} was built for {dtype} on {device}: the engine lays the "
                    "parameters out in that dtype and on that device at construction. Cast or "
                    f"move the model first, then build the optimizer (model.to(...); opt = "
                    f"{owner}(model.parameters(), ...)); to keep this optimizer, cast the model "
                    "back")


class _GradHook:
    """A parameter's post-accumulate-grad hook; holds its layout weakly, so that the optimizer
    can be collected (and give its parameters their own memory) while the model lives."""

    def __init__(self, layout: Resident, index: int) -> None:
        self._layout = weakref.ref(layout)
        self._index = index

    def __call__(self, _: torch.Tensor) -> None:
        layout = self._layout()
        if layout is not None:
            layout.on_gradient(self._index)
