"""Gradient accumulation as trainers and frameworks drive it: by default the optimizer follows
the trainer's count of backward passes per step() ("auto"), exact on every step, the first and
an epoch's short last window included (the HF Trainer's and Lightning's accumulation)."""

import re

import pytest
import torch
from torch import nn

import strata.torch as st
import training


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 4))


def micro_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def backward(model: nn.Module, i: int, window: int = 1) -> None:
    x, y = micro_batch(i)
    (((model(x) - y) ** 2).mean() / window).backward()


def train(model: nn.Module, opt: torch.optim.Optimizer, windows: list[int]) -> None:
    """As the HF Trainer accumulates: each window's backward passes on loss / its length, then
    step() and zero_grad()."""
    i = 0
    for window in windows:
        for _ in range(window):
            backward(model, i, window)
            i += 1
        opt.step()
        opt.zero_grad()


# An epoch of 10 micro-batches in windows of 3 (the last one short), then the next epoch's.
WINDOWS = [3, 3, 3, 1, 3, 3, 3, 1]


@pytest.mark.parametrize("chunk_size", ["64MiB", "4KiB"])  # One chunk, or several.
def test_auto_follows_the_trainers_windows_exactly(chunk_size):
    model, reference = mlp(), mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=1e-2, chunk_size=chunk_size)
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    assert opt.gradient_accumulation_steps == "auto"
    train(model, opt, WINDOWS)
    train(reference, ropt, WINDOWS)
    assert training.relative_difference(model, reference) < 1e-6
    assert opt.last_step["step"] == len(WINDOWS)


def test_auto_overlaps_once_a_step_has_shown_the_window():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=1e-2, chunk_size="4KiB")
    # The first step: nothing goes to the engine before step().
    backward(model, 0, 2)
    backward(model, 1, 2)
    assert not any(opt._body.state.handed)
    opt.step()
    opt.zero_grad()
    # Now it knows: after two backward passes every chunk is with the engine, updating.
    backward(model, 2, 2)
    backward(model, 3, 2)
    assert all(opt._body.state.handed)
    opt.step()
    assert opt.metrics()["rolled_back_updates"] == 0


def test_discarded_windows_leave_no_trace_before_or_after_the_hand_over():
    # zero_grad() drops a backward as torch does, whether the chunks were with the engine (after
    # two passes, once the rhythm is known) or not yet (after one).
    runs = []
    for make in (lambda p: st.OffloadAdamW(p, lr=1e-2, chunk_size="4KiB"),
                 lambda p: torch.optim.AdamW(p, lr=1e-2)):
        model = mlp()
        opt = make(model.parameters())
        backward(model, 0, 2)
        backward(model, 1, 2)
        opt.zero_grad()  # The first step's window, dropped.
        train(model, opt, [2])
        backward(model, 2, 2)
        opt.zero_grad()  # One pass of two, dropped.
        backward(model, 2, 2)
        backward(model, 3, 2)
        opt.zero_grad()  # A whole window, handed over, dropped.
        train(model, opt, [2, 2])
        runs.append(model)
    assert training.relative_difference(*runs) < 1e-6


def test_a_window_longer_than_any_before_is_exact():
    # The chunks went to the engine after one pass, as every window before had; the second pass
    # takes them back (what the engine did is dropped) and step() hands the sums over.
    runs = []
    for make in (lambda p: st.OffloadAdamW(p, lr=1e-2, chunk_size="4KiB"),
                 lambda p: torch.optim.AdamW(p, lr=1e-2)):
        model = mlp()
        train(model, make(model.parameters()), [1, 1, 3, 1, 2, 3])
        runs.append(model)
    assert training.relative_difference(*runs) < 1e-6


def test_an_explicit_count_overlaps_from_the_first_step():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=1e-2, gradient_accumulation_steps=2)
    backward(model, 0, 2)
    backward(model, 1, 2)
    assert all(opt._body.state.handed)
    opt.step()
    assert opt.last_step["step"] == 1


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True, None])
def test_a_count_that_is_neither_auto_nor_positive_is_refused(bad):
    with pytest.raises(ValueError, match="'auto' or an integer >= 1"):
        st.OffloadAdamW(mlp().parameters(), gradient_accumulation_steps=bad)


def test_reentrant_checkpointing_is_exact_with_auto():
    # Reentrant checkpointing runs the hook of a parameter used inside and outside the
    # checkpointed function twice per backward; "auto" counts two passes per step for it.
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

    def loss(model, i):
        x, y = micro_batch(i)
        x = x.requires_grad_(True)
        h = torch.utils.checkpoint.checkpoint(model[0], x, use_reentrant=True)
        return ((model[0](h) + model[1](h)) - y[:, :1]).pow(2).mean()

    model, reference = make(), make()
    opt = st.OffloadAdamW(model.parameters(), lr=1e-2, chunk_size="4KiB")
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for m, o in ((model, opt), (reference, ropt)):
        for i in range(4):
            loss(m, i).backward()
            o.step()
            o.zero_grad()
    assert training.relative_difference(model, reference) < 1e-6
