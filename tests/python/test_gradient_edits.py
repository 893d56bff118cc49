"""Whatever a training loop does to the gradients between backward() and step(), the step equals
torch.optim.AdamW's on the gradients as they are when step() is called — although the
optimizer's updates start during backward. Each edit runs 30 steps against torch (losses within
1e-5, parameters within 1e-4) and three times over (identical each time: an edit that races
with the updates made during backward must not make results depend on timing)."""

import math

import pytest
import torch
from torch import nn

import strata.torch as st

STEPS = 30


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(),
                         nn.Linear(96, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)


def loss_of(net: nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return ((net(x) - y) ** 2).mean()


# What the loop does after backward() and before step(), to the model and its step's number.
def clip_norm(net, _):
    nn.utils.clip_grad_norm_(net.parameters(), 0.05)


def clip_norm_never_clipping(net, _):
    nn.utils.clip_grad_norm_(net.parameters(), 1e9)  # Multiplies by exactly 1.


def clip_value(net, _):
    nn.utils.clip_grad_value_(net.parameters(), 0.01)


def clamp_through_data(net, _):
    for p in net.parameters():
        p.grad.data.clamp_(-0.01, 0.01)


def scale_through_data(net, step):
    for p in net.parameters():
        p.grad.data.mul_(0.5 if step % 2 else 1.0)


def replace_grad(net, _):
    for p in net.parameters():
        p.grad = p.grad * 0.25


def drop_one_grad(net, step):
    if step % 3 == 0:
        net[2].weight.grad = None  # torch skips that parameter this step.


EDITS = [None, clip_norm, clip_norm_never_clipping, clip_value, clamp_through_data,
         scale_through_data, replace_grad, drop_one_grad]


def train(make_optimizer, edit) -> tuple[list[float], nn.Module]:
    net = model()
    opt = make_optimizer(net.parameters())
    losses = []
    for step in range(STEPS):
        loss = loss_of(net, step)
        loss.backward()
        if edit is not None:
            edit(net, step)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, net


def offload(params, speculative_updates=True):
    # Several chunks, updated during backward (the path that redoes what an edit changed).
    return st.OffloadAdamW(params, lr=1e-2, chunk_size="16KiB",
                           speculative_updates=speculative_updates)


def offload_waiting(params):
    return offload(params, speculative_updates=None)  # The default on CPU tensors.


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def assert_close(run, reference, loss_tolerance=1e-5):
    (losses, net), (reference_losses, reference_net) = run, reference
    worst = max((abs(a - b) for a, b in zip(losses, reference_losses)), default=0.0)
    assert worst < loss_tolerance, worst
    apart = max((a - b).abs().max().item()
                for a, b in zip(net.parameters(), reference_net.parameters()))
    assert apart < 1e-4, apart


def assert_identical(a, b):
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1].parameters(), b[1].parameters()))


@pytest.mark.parametrize("edit", EDITS, ids=lambda e: "none" if e is None else e.__name__)
def test_an_edit_between_backward_and_step_gives_torchs_step_every_time(edit):
    reference = train(torch_adamw, edit)
    runs = [train(offload, edit) for _ in range(3)]
    assert_close(runs[0], reference)
    assert_identical(runs[0], runs[1])
    assert_identical(runs[0], runs[2])
    assert_close(train(offload_waiting, edit), reference)


def test_a_skipped_batch_is_dropped_after_its_updates_started():
    def loop(make_optimizer):
        net = model()
        opt = make_optimizer(net.parameters())
        for step in range(STEPS):
            loss_of(net, step).backward()
            if step % 4 == 3:
                opt.zero_grad()  # A bad batch: skipped.
                continue
            opt.step()
            opt.zero_grad()
        return [], net

    assert_close(loop(offload), loop(torch_adamw))


# torch.amp.GradScaler with fp32 parameters and fp16 autocast, the recipe torch documents:
# unscale_ rewrites the gradients after backward, and an overflow skips step().
@pytest.mark.parametrize("init_scale", [2.0**10, 2.0**127])  # Overflowing at first, or not.
def test_grad_scaler_gives_torchs_steps_and_skips(init_scale):
    def loop(make_optimizer):
        net = model()
        opt = make_optimizer(net.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=5)
        losses, scales = [], []
        for step in range(STEPS):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(net, step)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
        return losses, net, scales

    *run, scales = loop(offload)
    *reference, reference_scales = loop(torch_adamw)
    assert scales == reference_scales
    if init_scale > 2.0**100:
        assert scales[0] < init_scale  # The first steps overflowed and were skipped.
    assert all(math.isfinite(a) for a in run[0])
    # An fp16 forward rounds to 2^-11 of the loss: parameters apart by float noise (Adam's
    # arithmetic in another order) may round a product the other way.
    assert_close(tuple(run), tuple(reference), loss_tolerance=2.0**-11)
