"""strata.torch on CUDA tensors, against torch.optim.AdamW on the same GPU: fp32 to the CPU
tests' tolerance and bf16 to theirs, states in host memory and on NVMe, with clipping,
accumulation and a state_dict round trip, and gradients that the trainer's stream produces late
(the engine must copy them after that stream's work, not before).

Label `gpu` (tests/CMakeLists.txt): without a usable GPU every test skips, and under
STRATA_EXPECT_GPU=1 (scripts/gpu-proof.sh) that is a failure. STRATA_TEST_NVME_DIR names a
folder where O_DIRECT works for the NVMe tier when the temporary folder's file system refuses it
(tmpfs, overlay)."""

from __future__ import annotations

import io
import os
import tempfile

import pytest
import torch
from torch import nn

import strata
import strata.torch
import training

STEPS = 50
GAS = 4
LR = 3e-3
MAX_NORM = 0.5  # Most steps clip.
BF16_TOLERANCE = 1e-2  # test_equivalence.py's, for the same models and steps.


def _why_no_gpu() -> str | None:
    if not strata.built_with_cuda():
        return "strata was built without CUDA"
    if not torch.cuda.is_available():
        return "torch sees no usable CUDA device"
    return None


@pytest.fixture(autouse=True)
def gpu():
    why = _why_no_gpu()
    if why is None:
        return
    if os.environ.get("STRATA_EXPECT_GPU") == "1":
        pytest.fail(f"a GPU was expected (STRATA_EXPECT_GPU=1): {why}")
    pytest.skip(why)


@pytest.fixture
def nvme_dir(tmp_path):
    """A folder of this test's own for the NVMe tier, where O_DIRECT works."""
    parent = os.environ.get("STRATA_TEST_NVME_DIR")
    if not parent:
        yield str(tmp_path)
        return
    with tempfile.TemporaryDirectory(prefix="strata-test-", dir=parent) as folder:
        yield folder


def torch_run(kind: str, steps: range = range(STEPS)) -> tuple[nn.Module, list[float]]:
    model = training.make_model(kind).cuda()
    opt = training.make_optimizer("torch", model, lr=LR, max_grad_norm=MAX_NORM, gas=GAS)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    losses = training.train(kind, model, opt, scheduler, steps, gas=GAS, max_grad_norm=MAX_NORM,
                            device="cuda")
    return model, losses


def strata_optimizer(offload: str, model: nn.Module, nvme_path: str | None):
    return training.make_optimizer(offload, model, lr=LR, max_grad_norm=MAX_NORM, gas=GAS,
                                   nvme_path=nvme_path)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_offload_adamw_on_cuda_matches_torch_adamw(kind, offload, nvme_dir):
    reference, reference_losses = torch_run(kind)
    model = training.make_model(kind).cuda()
    opt = strata_optimizer(offload, model, nvme_dir if offload == "nvme" else None)
    assert opt._native.chunk_count > 2, "several chunks, so updates overlap backward"
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    losses = training.train(kind, model, opt, scheduler, range(STEPS), gas=GAS,
                            max_grad_norm=MAX_NORM, device="cuda")
    assert all(p.is_cuda for p in model.parameters())
    assert training.relative_difference(model, reference) < 1e-6
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    assert losses[-1] < losses[0]
    metrics = opt.metrics()
    # A GPU: gradients come down and parameters go up through copies, not in place.
    assert metrics["device_to_host_bytes"] > 0
    assert metrics["host_to_device_bytes"] > 0
    if offload == "nvme":
        assert metrics["nvme_write_bytes"] > 0
    opt.close()


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_bf16_on_cuda_stays_close_to_fp32_training(kind):
    reference, reference_losses = torch_run(kind)
    model = training.make_model(kind).to(device="cuda", dtype=torch.bfloat16)
    opt = strata_optimizer("cpu", model, None)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    losses = training.train(kind, model, opt, scheduler, range(STEPS), gas=GAS,
                            max_grad_norm=MAX_NORM, device="cuda")
    masters = opt.state_dict()["state"]  # Numbered in param_groups order.
    ordered = [p for g in opt.param_groups for p in g["params"]]
    fp32 = dict(zip(map(id, model.parameters()), reference.parameters()))
    trained = [(masters[i]["master"].float().cpu(), fp32[id(p)].detach().float().cpu())
               for i, p in enumerate(ordered) if p.requires_grad]
    for i, p in enumerate(ordered):
        if p.requires_grad:
            # The working parameter on the GPU is the master rounded to bf16.
            assert torch.equal(masters[i]["master"].cpu().to(torch.bfloat16), p.detach().cpu())
    distance = sum(((m - r) ** 2).sum() for m, r in trained).sqrt()
    drift = (distance / sum((r ** 2).sum() for _, r in trained).sqrt()).item()
    print(f"{kind} on CUDA: bf16 masters vs fp32 training after {STEPS} steps: {drift:.1e}")
    assert drift < BF16_TOLERANCE
    assert losses[-1] == pytest.approx(reference_losses[-1], rel=1e-2)
    opt.close()


def test_a_state_dict_round_trip_on_cuda_continues_exactly(nvme_dir):
    kind, half = "transformer", STEPS // 2
    reference, _ = torch_run(kind)
    model = training.make_model(kind).cuda()
    opt = strata_optimizer("nvme", model, nvme_dir)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    training.train(kind, model, opt, scheduler, range(half), gas=GAS, max_grad_norm=MAX_NORM,
                   device="cuda")
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": scheduler.state_dict()}, saved)
    opt.close()
    saved.seek(0)
    checkpoint = torch.load(saved, map_location="cuda", weights_only=False)

    # Another model and optimizer, states in host memory this time.
    again = training.make_model(kind).cuda()
    again.load_state_dict(checkpoint["model"])
    opt_again = strata_optimizer("cpu", again, None)
    opt_again.load_state_dict(checkpoint["optimizer"])
    scheduler_again = torch.optim.lr_scheduler.CosineAnnealingLR(opt_again, T_max=STEPS)
    scheduler_again.load_state_dict(checkpoint["scheduler"])
    training.train(kind, again, opt_again, scheduler_again, range(half, STEPS), gas=GAS,
                   max_grad_norm=MAX_NORM, device="cuda")
    assert training.relative_difference(again, reference) < 1e-6
    opt_again.close()


# About 20 ms of GPU time (torch.cuda._sleep counts clock cycles; ~1.4-2 GHz).
SLEEP_CYCLES = 30_000_000


class LateWeightGradient(torch.autograd.Function):
    """x @ w.T whose backward first keeps the stream busy, then writes the weight's gradient:
    an engine copy that did not wait for the trainer's stream would read the gradient buffer
    before backward had written it (zeros, or the last micro-step's)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        torch.cuda._sleep(SLEEP_CYCLES)
        return g @ w, g.t() @ x


class SlowLinear(nn.Linear):
    def forward(self, x):
        return LateWeightGradient.apply(x, self.weight) + self.bias


def slow_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(SlowLinear(24, 64), nn.GELU(), SlowLinear(64, 64), nn.GELU(),
                         SlowLinear(64, 8)).cuda()


def train_slow(model: nn.Module, opt: torch.optim.Optimizer, stream: torch.cuda.Stream,
               steps: int = 6, gas: int = 2) -> None:
    reference = not isinstance(opt, strata.torch.OffloadOptimizer)
    with torch.cuda.stream(stream):
        for step in range(steps):
            for micro in range(gas):
                x, y = (t.cuda() for t in training.batch("mlp", step, micro))
                (((model(x) - y) ** 2).mean() / gas).backward()
            if reference:
                nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
    stream.synchronize()


@pytest.mark.parametrize("where", ["default stream", "side stream"])
def test_gradients_are_copied_after_the_trainers_stream_wrote_them(where):
    stream = (torch.cuda.current_stream() if where == "default stream"
              else torch.cuda.Stream())
    reference = slow_model()
    train_slow(reference, torch.optim.AdamW(reference.parameters(), lr=LR), stream)
    model = slow_model()
    opt = strata.torch.OffloadAdamW(model.parameters(), lr=LR, max_grad_norm=MAX_NORM,
                                    gradient_accumulation_steps=2, chunk_size="16KiB")
    assert opt._native.chunk_count > 1, "several chunks: copies start during backward"
    train_slow(model, opt, stream)
    assert training.relative_difference(model, reference) < 1e-6
    opt.close()
