"""The native engine handle: the only code in strata.torch that calls the C++ module.

``NativeEngine`` wraps one ``_strata.Engine`` (engine.h's trainer contract, one call for one
call) with what every caller needs around each call, written once: the parameters' device
selected on the calling thread (_device.selected), the trainer's current stream named for the
engine to order its work after (_device.trainer_stream), chunk memory as torch tensors viewing
the engine's (DLPack), and states read and written as flat fp32 host tensors in one batch.
The module's free functions (configs, ranks, sizes) are re-exported here for the same reason.

One per optimizer; calls come from the trainer's thread (or autograd's, one hook at a time).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from strata import _strata
from strata.torch import _device

# The engine's parameter states (engine.h's ParameterState): the fp32 master and two moments.
MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2

parse_bytes = _strata.parse_bytes
parse_config = _strata.parse_config
load_config = _strata.load_config
detect_ranks = _strata.detect_ranks


class NativeEngine:
    """One engine for one optimizer's parameters, on `device`.

    ``raw`` is the binding's engine object; tests may wrap it to inject failures."""

    def __init__(self, options: dict[str, Any], registered: list[tuple], device: torch.device,
                 *, fit_host_device: bool) -> None:
        self.device = device
        with self.selected():
            self.raw = _strata.Engine(json.dumps(options), registered,
                                      fit_host_device=fit_host_device)

    # ------------------------------------------------------------------ device and stream

    def selected(self) -> Any:
        return _device.selected(self.device)

    def stream(self) -> int:
        return _device.trainer_stream(self.device)

    # ------------------------------------------------------------------------------ chunks

    @property
    def chunk_count(self) -> int:
        return self.raw.chunk_count

    def location(self, i: int) -> tuple[int, int, int]:
        """Parameter i's (chunk, offset, numel) in the engine."""
        return self.raw.location(i)

    def chunk(self, c: int) -> tuple:
        """Chunk c's description (name, ..., home tier: engine.h's ChunkInfo)."""
        return self.raw.chunk(c)

    def acquire(self, c: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Chunk c's working parameters and gradient buffer on the device (None: frozen), held
        until release(c)."""
        with self.selected():
            params, grads = self.raw.acquire(c)
        return torch.from_dlpack(params), None if grads is None else torch.from_dlpack(grads)

    def release(self, c: int) -> None:
        """Lets chunk c go once the trainer's current stream is done with it."""
        stream = self.stream()
        with self.selected():
            self.raw.release(c, stream)

    def chunk_memory(self, c: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A device-home chunk's memory, which stays put for the engine's life."""
        views = self.acquire(c)
        self.release(c)
        return views

    def hand_over(self, c: int, *, acquired: bool = False) -> None:
        """Chunk c's gradient buffer is complete: the engine takes it (GradsReady; its update
        may start at once) and the trainer lets the chunk go. `acquired`: the trainer already
        holds it (else it is acquired around the call)."""
        stream = self.stream()
        with self.selected():
            if not acquired:
                self.raw.acquire(c)
            try:
                self.raw.grads_ready(c, stream)
            finally:
                self.raw.release(c, stream)

    # ------------------------------------------------------------------------------- steps

    def step(self) -> dict[str, Any]:
        """Finishes the open step; its report (StepReport's fields)."""
        with self.selected():
            return self.raw.step()

    def abandon_step(self) -> None:
        """Drops the open step: its gradients and every update made ahead of step()."""
        with self.selected():
            self.raw.abandon_step()

    @property
    def iteration_count(self) -> int:
        return self.raw.iteration_count

    @property
    def step_count(self) -> int:
        return self.raw.step_count

    def set_step_count(self, steps: int) -> None:
        with self.selected():
            self.raw.set_step_count(steps)

    @property
    def loss_scale(self) -> float:
        return self.raw.loss_scale

    def set_learning_rate(self, lr: float) -> None:
        self.raw.set_learning_rate(lr)

    # ------------------------------------------------------------------------------ states

    def read_states(self, wanted: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """States (parameter index, kind, engine numel) as flat fp32 host tensors, in one
        engine call."""
        if not wanted:
            return []
        out = [torch.empty(numel, dtype=torch.float32) for _, _, numel in wanted]
        with self.selected():
            self.raw.read_states([(i, kind, o.numpy())
                                  for (i, kind, _), o in zip(wanted, out)])
        return out

    def write_states(self, batch: list[tuple[int, int, torch.Tensor]]) -> None:
        """(parameter index, kind, flat fp32 host tensor of the engine's numel), in one call."""
        if batch:
            with self.selected():
                self.raw.write_states([(i, kind, t.numpy()) for i, kind, t in batch])

    # ----------------------------------------------------------------------------- metrics

    def counters(self) -> dict[str, Any]:
        return dict(self.raw.counters())

    def metrics_text(self) -> str:
        return self.raw.metrics_text()
