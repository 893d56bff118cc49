"""The step body: one optimizer step's life, the same for every layout (_layout.py).

A step's life: closed -> open (its first gradient: torch-side changes reach the engine, the
learning rate is read from param_groups) -> chunks handed over (during backward, or at step())
-> closed by step(), once the engine completed it. zero_grad() before step() discards the step
as torch would where the layout can (the engine drops what it did for it: take_back). A failed
engine step keeps the step open, every call but a plain step() is refused, and the next step()
retries it; whether the engine finished is its iteration count's business, not the exception's
(a Ctrl-C can arrive just after a successful call returns).

The states of parameters without a gradient in a chunk that is handed over are saved before
(save_untouched) and put back after the step (restore_untouched): the engine updates them with
zeros, torch leaves them alone. Until written they stay pending, and the next step or state
access tries again.

Everything runs on the trainer's thread (or autograd's, one hook at a time). The body holds no
reference to its optimizer, so that the optimizer's finalizer can run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from strata.torch._hyper import GroupSettings
from strata.torch._layout import Layout, Prepared
from strata.torch._native import MASTER, NativeEngine
from strata.torch._params import ParamTable
from strata.torch._step_state import StepState


class StepBody:
    def __init__(self, owner: str, native: NativeEngine, table: ParamTable, layout: Layout,
                 settings: GroupSettings, state_kinds: list[int]) -> None:
        self.owner = owner  # The optimizer class's name, for messages.
        self.native = native
        self.table = table
        self.layout = layout
        self.settings = settings
        self._state_kinds = state_kinds  # The engine states the rule keeps (master aside).
        self.closed: str | None = None  # Why the optimizer no longer drives its parameters.
        self.retry_pending = False  # The engine's step failed; the next step() retries it.
        self.last_report: dict[str, Any] | None = None
        self.skipped_steps = 0
        # States of parameters without gradients to put back after a step, kept until written.
        self._restore_pending: list[tuple[int, int, torch.Tensor]] = []
        self.state = self._fresh_state()
        # Gives the parameters their own memory and removes the hooks (set by the optimizer).
        self.finalizer: Callable[[], Any] = lambda: None

    # ------------------------------------------------------------------ checks and closing

    def check_open(self, what: str, closure_given: bool = False) -> None:
        """Refuses calls on a closed optimizer, and anything but a plain step() while a failed
        step waits for its retry."""
        if self.closed is not None:
            raise RuntimeError(f"{what} on a closed {self.owner}: {self.closed}")
        if self.retry_pending and (what != "step()" or closure_given):
            raise RuntimeError(
                f"{what} while the last step() failed and waits for its retry: call opt.step() "
                "(without a closure) again to retry it first")

    def check_between_steps(self, what: str) -> None:
        """Refuses state access while a step is open; puts back pending states first."""
        self.check_open(what)
        if self.state.open:
            raise RuntimeError(
                f"{what} between backward() and step(): the engine is updating with this "
                "step's gradients; call it after step()")
        self.restore_untouched()

    def close(self, reason: str) -> None:
        """Gives the parameters their own memory, removes the hooks, and refuses every later
        call with `reason`."""
        self.finalizer()
        self.closed = reason

    def close_by_request(self) -> None:
        """close(): mid-step the open step is dropped first where the layout can; else a step
        with chunks handed over must be finished first."""
        if self.closed is not None:
            return
        handed = self.state.handed_chunks()
        if handed and not self.retry_pending:
            if not self.layout.takes_back:
                raise RuntimeError(
                    f"close() while chunks {handed} are updating with this step's gradients: "
                    "call step() to finish the step first")
            self.take_back()
        self.close("close() was called")

    # ------------------------------------------------------------------------ a step's life

    def _fresh_state(self) -> StepState:
        return StepState(self.table.members, len(self.table))

    def reset(self) -> None:
        self.state = self._fresh_state()

    def begin(self) -> None:
        """At the first gradient of a step: what torch-side code changed since the last step
        (parameters loaded in place, a scheduler's learning rate) reaches the engine."""
        self.check_open("backward()")
        self.restore_untouched()
        for r, p in zip(self.table.records, self.table.params):
            if p.requires_grad != r.trained:
                now = "trainable" if p.requires_grad else "frozen"
                raise NotImplementedError(
                    f"parameter {r.index} (shape {tuple(p.shape)}) is {now} now but was not "
                    f"when {self.owner} was built: the engine packs frozen and trained "
                    "parameters apart at construction, so changing requires_grad needs a new "
                    "optimizer (build it after freezing or unfreezing)")
        base = self.settings.base_learning_rate()
        self.layout.begin_step(self.state)
        self.native.set_learning_rate(base)
        self.state.open = True

    def take_back(self) -> None:
        """The engine drops the open step (its gradients and every update made ahead of
        step()), so no chunk is with it any more; the gradients stay in ``.grad``."""
        self.native.abandon_step()
        self.state.took_back()

    def step(self) -> str | None:
        """step()'s body, after the closure: hands over what is left, runs the engine's step
        and lets the layout publish it. Returns an error to raise about the step (the
        gradients changed after the engine took them). Once the engine's step completed, its
        report is the last one even if what follows raises."""
        layout = self.layout
        prepared = Prepared()
        if not self.retry_pending:
            prepared = layout.prepare_step(self.state)
            if not prepared.proceed:
                self.reset()
                return None
        grad_norm = self.state.grad_norm

        def finished() -> None:
            self._restore_pending += self.state.untouched
            layout.step_completed(self.state)
            self.reset()
        before = self.native.iteration_count
        try:
            report = self.native.step()
        finally:
            self.retry_pending = self.native.iteration_count == before
            if not self.retry_pending:
                finished()
        self.last_report = report
        if report["skipped"]:
            self.skipped_steps += 1
        self.restore_untouched()
        layout.finish_step(report, grad_norm)
        return prepared.deferred_error

    def zero_grad(self) -> bool:
        """zero_grad(): whether torch's zero_grad should follow (the layout decides)."""
        self.check_open("zero_grad()")
        return self.layout.zero_grad(self.state)

    def discard(self) -> None:
        """Drops an open step none of whose chunks is with the engine, or takes them back."""
        handed = self.state.handed_chunks()
        if handed and self.layout.takes_back:
            self.take_back()
        elif handed:
            raise RuntimeError(
                f"zero_grad() after backward() without step(): chunks {handed} already "
                "started updating with those gradients (the update overlaps backward); call "
                "step() to finish the step, or build the optimizer with overlap=False to be "
                "able to discard a backward")
        self.reset()

    def refuse_grad_scaler(self, scale: Any, zero_grad: Callable[[], None]) -> None:
        """torch.amp.GradScaler handed step() its scale (the optimizer supports amp scaling
        where the engine does not recheck gradients): refused, with the step discarded where
        nothing was handed over, and the optimizer closed where chunks were updated with
        scaled gradients."""
        advice = ("Use fp16 parameters with opt.scale(loss).backward() (the engine scales, checks "
                  "and skips), or bf16")
        if not self.state.handed_chunks():
            self.reset()
            zero_grad()
            raise NotImplementedError(
                f"torch.amp.GradScaler does not work with {self.owner}: this step was "
                f"discarded. {advice}")
        scale_value = float(scale) if scale is not None else float("nan")
        self.close(
            "torch.amp.GradScaler was used with it: chunks had already been updated with "
            f"gradients multiplied by the loss scale ({scale_value:g}), so its parameters and "
            "states are corrupted")
        raise NotImplementedError(
            f"torch.amp.GradScaler does not work with {self.owner}: the updates start during "
            "backward, before the scaler could unscale the gradients, so chunks were updated "
            f"with gradients multiplied by the loss scale ({scale_value:g}) and the parameters "
            "and optimizer states are corrupted; reload both from a checkpoint into a new "
            f"optimizer. {advice}")

    # --------------------------------------------------------- states of untouched parameters

    def save_untouched(self, indices: list[int]) -> None:
        """Saves the master and states of parameters without a gradient this step, to be put
        back after it (restore_untouched): the engine updates them with zeros, torch not."""
        kinds = [MASTER, *self._state_kinds]
        saved = [(i, k) for i in indices for k in kinds]
        self.state.untouched += [
            (i, k, v) for (i, k), v in zip(saved, self.layout.read_states(saved))]

    def restore_untouched(self) -> None:
        """Puts back the states saved by save_untouched; on an error they stay pending and the
        next step or state access tries again."""
        if self._restore_pending:
            # As read_states gave them: the engine's part of each (a mirrored layout's slice,
            # an empty part's stand-in), not the whole parameters state_batch checks for.
            self.layout.write_state_batch(self._restore_pending)
            self._restore_pending = []
