"""What one optimizer step has gathered between its first gradient and step(): the backward
passes each parameter has seen, which chunks are with the engine (and how many micro-steps of
each), which gradients sit in their chunk's buffer, and the states to put back after it. The
step body (_step.py) keeps one, for every layout, and replaces it at every step's end (step(),
a discarded step); only it and its layout touch it, on the trainer's thread."""

from __future__ import annotations

import torch


class StepState:
    def __init__(self, members: list[list[int]], parameters: int) -> None:
        # The first gradient of the step arrived: torch-side changes have reached the engine.
        self.open = False
        # Backward passes that reached each parameter this step.
        self.counts = [0] * parameters
        # Per chunk: micro-steps of gradients handed to the engine (grads_ready); resident
        # layouts hand a chunk over once per step.
        self.handed = [0] * len(members)
        # (parameter, state kind, values) of parameters without a gradient in a chunk handed
        # over, to put back after the step: the engine updates them with zeros, torch not.
        self.untouched: list[tuple[int, int, torch.Tensor]] = []
        # The gradients' norm over every rank, where the layout takes it (mirrored).
        self.grad_norm: float | None = None

        # Resident and mirrored layouts (_resident.py):
        # Its gradient is in its chunk's buffer (Resident.place_gradient).
        self.placed = [False] * parameters
        # Per chunk: its trained parameters without their last gradient yet.
        self.waiting = [len(m) for m in members]
        # Chunk -> its gradient buffer's version once placed (the GPU's change check).
        self.placed_version: dict[int, int] = {}
        # Mirrored: parameter -> the gradient tensor whose values were copied into its
        # chunk's buffer, to tell it from one that replaced it.
        self.placed_gradient: dict[int, torch.Tensor] = {}

    def handed_chunks(self) -> list[int]:
        """The chunks with the engine."""
        return [c for c, n in enumerate(self.handed) if n]

    def backward_passes(self) -> int:
        """The most micro-steps handed over for any chunk."""
        return max(self.handed, default=0)

    def took_back(self) -> None:
        """The engine dropped the step: no chunk is with it any more."""
        self.handed = [0] * len(self.handed)

    def restart(self, discarded: list[int], members: list[list[int]]) -> None:
        """Parameters whose gradient the loop discarded since it was placed count backward
        passes afresh, and their chunks wait for them again."""
        for i in discarded:
            self.counts[i] = 0
            self.placed[i] = False
        self.waiting = [sum(not self.placed[i] for i in m) for m in members]
