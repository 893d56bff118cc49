"""Fixtures the pytest suites share.

``updates_ahead``: makes an update run ahead of step() before the trainer edits the gradients,
so that a test of what the engine redoes does not depend on how fast its threads ran. The
engine starts a chunk's update once backward hands the chunk over, on its own threads; a clip
that came first would leave nothing to redo and the test would pass by chance or fail by it.
"""

from __future__ import annotations

import time

import pytest
import torch

# Generous for a loaded 2-core machine: an update of a small chunk starts within milliseconds.
UPDATE_START_TIMEOUT = 120.0


class UpdatesAhead:
    """Waits, before every clip torch.nn.utils makes (a framework's or the test's own), until
    the engine of each optimizer `watch`ed has started an update of this step ahead of step(),
    where backward handed a chunk to it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._optimizers: list = []
        self._started_before: dict[int, int] = {}
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            clip = getattr(torch.nn.utils, name)
            monkeypatch.setattr(torch.nn.utils, name, self._waiting_before(clip))

    def watch(self, opt) -> None:
        self._optimizers.append(opt)
        step = opt.step

        def step_and_count(*args, **kwargs):
            try:
                return step(*args, **kwargs)
            finally:
                self._started_before[id(opt)] = _started(opt)
        opt.step = step_and_count

    def _waiting_before(self, clip):
        def waiting_clip(*args, **kwargs):
            for opt in self._optimizers:
                self.wait(opt)
            return clip(*args, **kwargs)
        return waiting_clip

    def wait(self, opt) -> None:
        """Until an update of the open step has started (none can when no chunk was handed
        over during backward: the first step of gradient_accumulation_steps='auto')."""
        if not opt._body.state.handed_chunks():
            return
        before = self._started_before.get(id(opt), 0)
        deadline = time.monotonic() + UPDATE_START_TIMEOUT
        while _started(opt) <= before:
            assert time.monotonic() < deadline, "no update started ahead of step()"
            time.sleep(0.001)


def _started(opt) -> int:
    return int(opt.metrics()["speculative_updates"])


@pytest.fixture
def updates_ahead(monkeypatch) -> UpdatesAhead:
    return UpdatesAhead(monkeypatch)
