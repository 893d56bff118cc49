"""Parameters offloaded by ``offload_parameters``: they live off the device between uses
(placement.params host or nvme), and a ParameterResidency (_residency.py) puts them there while
their modules run. Each chunk's gradients go to the engine during backward, once per
micro-step; the engine sums the micro-steps (so gradient accumulation needs its count up front)
and a chunk that missed one gets zeros for it at step(). The gradients do not stay on the
device, so nothing handed over can be taken back: a step once begun is finished by step()."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from strata.torch._layout import Layout, Prepared
from strata.torch._offload_plan import OffloadPlan, place
from strata.torch._residency import ParameterResidency

if TYPE_CHECKING:
    from strata.torch._native import NativeEngine
    from strata.torch._params import ParamTable
    from strata.torch._step import StepBody
    from strata.torch._step_state import StepState


class Offloaded(Layout):
    def __init__(self, params: list[torch.Tensor], plan: OffloadPlan, *,
                 gradient_accumulation_steps: int | str) -> None:
        super().__init__(params)
        self.plan = plan
        # The engine sums the micro-steps: their count ("auto" = 1, since it must be known
        # before the first backward).
        gas = gradient_accumulation_steps
        self.accumulation = 1 if gas == "auto" else gas
        self.fits_host_device = plan.device_memory is None
        self.residency: ParameterResidency | None = None
        self._body: StepBody | None = None

    def configure(self, options: dict[str, Any]) -> None:
        place(options, self.plan, self.accumulation)

    def attach(self, native: NativeEngine, table: ParamTable, body: StepBody) -> list[Any]:
        super().attach(native, table, body)
        self._body = weakref.proxy(body)  # The body holds this layout: no cycle.
        self.residency = ParameterResidency(self.plan.model(), native, table, body, self,
                                            self.accumulation)
        return [self.residency.remove]

    def prepare_step(self, state: StepState) -> Prepared:
        if state.backward_passes() == 0:
            self.residency.after_interruption()
            raise RuntimeError(
                "step() before any backward(): no parameter received a gradient since the last "
                "step()")
        self._hand_over_missed_micro_steps(state)
        return Prepared()

    def _hand_over_missed_micro_steps(self, state: StepState) -> None:
        """Hands every chunk that took part in this step zeros for the micro-steps it missed,
        up to the accumulation count. The engine sums micro-steps, so the sum is torch's: a
        module used in some micro-steps only, and a window cut short (the HF Trainer's last at
        an epoch's end: step() after fewer backward passes) train as in torch."""
        residency, native = self.residency, self.native
        residency.after_interruption()
        busy = [c for c, n in enumerate(residency.uses) if n]
        if busy:
            raise RuntimeError(f"step() while a forward pass holds chunks {busy}")
        residency.keep_untouched([c for c, n in enumerate(state.handed)
                                  if 0 < n < self.accumulation])
        for c, n in enumerate(state.handed):
            for _ in range(n, self.accumulation if n else 0):
                _, grads = native.acquire(c)
                try:
                    grads.zero_()
                except BaseException:
                    native.release(c)
                    raise
                native.hand_over(c, acquired=True)
                state.handed[c] += 1

    def zero_grad(self, state: StepState) -> bool:
        self.residency.after_interruption()
        handed = state.handed_chunks()
        if handed and not self._body.retry_pending:
            raise RuntimeError(
                f"zero_grad() after backward() without step(): with offload_parameters the "
                f"gradients of chunks {handed} went to the engine during backward (they do "
                "not stay on the device); call step() to finish the step")
        self.residency.clear_gradients()
        return False

    @property
    def takes_back(self) -> bool:
        return False

    def interrupted(self) -> None:
        self.residency.after_interruption()

    def metrics(self, out: dict[str, Any]) -> None:
        # Parameters filled for the modules running (torch's tensors, beside the engine's
        # device copies that device_peak_bytes counts).
        out["filled_param_bytes"] = self.residency.filled_bytes
        out["filled_param_peak_bytes"] = self.residency.peak_filled_bytes
