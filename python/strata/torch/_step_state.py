"""What one optimizer step has gathered between its first gradient hook and step(): the
backward passes each parameter has seen, which gradients sit in their chunk's buffer, and which
chunks are with the engine. OffloadOptimizer keeps one and replaces it at every step's end
(step(), a discarded step); only it and its hooks touch it, on the trainer's thread."""

from __future__ import annotations

import torch


class StepState:
    def __init__(self, members: list[list[int]], parameters: int) -> None:
        # Backward passes that reached each parameter this step.
        self.counts = [0] * parameters
        # Its gradient is in its chunk's buffer (OffloadOptimizer._place_gradient).
        self.placed = [False] * parameters
        # Per chunk: its trained parameters without their last gradient yet.
        self.waiting = [len(m) for m in members]
        # Per chunk: handed to the engine (grads_ready), its update started.
        self.submitted = [False] * len(members)
        # Chunk -> its gradient buffer's version once placed (the GPU's change check).
        self.placed_version: dict[int, int] = {}
        # (parameter, state kind, values) of parameters without a gradient in a chunk handed
        # over in step(), to put back after the step (OffloadOptimizer._hand_over_the_rest).
        self.untouched: list[tuple[int, int, torch.Tensor]] = []
        # Sharded (FSDP2): parameter -> the gradient tensor whose values were copied into its
        # chunk's buffer, to tell it from one that replaced it.
        self.placed_gradient: dict[int, torch.Tensor] = {}
        # Sharded: the gradients' norm over every rank, taken by step().
        self.grad_norm: float | None = None
        # The first gradient hook ran: torch-side changes have reached the engine.
        self.open = False

    def handed(self) -> list[int]:
        """The chunks with the engine."""
        return [c for c, done in enumerate(self.submitted) if done]

    def took_back(self) -> None:
        """The engine dropped the step: no chunk is with it any more."""
        self.submitted = [False] * len(self.submitted)

    def restart(self, discarded: list[int], members: list[list[int]]) -> None:
        """Parameters whose gradient the loop discarded since it was placed count backward
        passes afresh, and their chunks wait for them again."""
        for i in discarded:
            self.counts[i] = 0
            self.placed[i] = False
        self.waiting = [sum(not self.placed[i] for i in m) for m in members]
