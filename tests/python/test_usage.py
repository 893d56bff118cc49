"""What a torch user does with an optimizer besides the training loop, and every bad use the
issue names: each either works as with torch.optim or raises an error that says what to do."""

import math
import subprocess

import pytest
import torch
from torch import nn

import strata.torch as st
import training


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def run(model, opt, steps, scheduler=None, set_to_none=True, first=0):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        ((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if scheduler is not None:
            scheduler.step()


def twin(**offload):
    """A model with OffloadAdamW and an identical one with torch.optim.AdamW."""
    model, reference = mlp(), mlp()
    groups = lambda m: [{"params": [m[0].weight, m[2].weight]},  # noqa: E731
                        {"params": [m[0].bias, m[2].bias], "lr": 2e-2, "weight_decay": 0.0}]
    return (model, st.OffloadAdamW(groups(model), lr=1e-2, **offload),
            reference, torch.optim.AdamW(groups(reference), lr=1e-2))


def close(a: nn.Module, b: nn.Module) -> float:
    return training.relative_difference(a, b)


SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "linear_warmup": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1,
                                                                 total_iters=4),
    "one_cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=[1e-2, 2e-2], total_steps=20, cycle_momentum=False),
    "plateau_free_sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, 0.9)], milestones=[2]),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_torch_lr_schedulers_drive_it_as_they_drive_adamw(name):
    model, opt, reference, ropt = twin()
    run(model, opt, 8, SCHEDULERS[name](opt))
    run(reference, ropt, 8, SCHEDULERS[name](ropt))
    assert close(model, reference) < 1e-6
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ropt.param_groups]


def test_a_schedule_the_engine_cannot_follow_raises():
    model, opt, _, _ = twin()
    per_group = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5 ** s])
    run(model, opt, 1, per_group)
    with pytest.raises(NotImplementedError, match="no longer keep the ratios"):
        run(model, opt, 1)
    model, opt, _, _ = twin()
    cycling = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    with pytest.raises(NotImplementedError, match="cycle_momentum=False"):
        run(model, opt, 2, cycling)


def test_zero_grad_without_set_to_none_accumulates_in_the_engines_buffers():
    model, opt, reference, ropt = twin()
    run(model, opt, 5, set_to_none=False)
    run(reference, ropt, 5, set_to_none=False)
    assert close(model, reference) < 1e-6
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in model.parameters())


def test_a_closure_runs_and_its_loss_is_returned():
    model, opt, _, _ = twin()
    x, y = torch.randn(4, 8), torch.randn(4, 4)

    def closure():
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() > 0 and opt.last_step["step"] == 1


def test_weights_loaded_after_construction_are_the_ones_trained():
    model, opt, reference, ropt = twin()
    run(model, opt, 2)
    run(reference, ropt, 2)
    other = mlp()
    for p in other.parameters():
        p.data.mul_(0.5)
    model.load_state_dict(other.state_dict())  # In place, into the engine's memory.
    reference.load_state_dict(other.state_dict())
    run(model, opt, 3, first=2)
    run(reference, ropt, 3, first=2)
    assert close(model, reference) < 1e-6
    # A parameter whose .data is replaced is copied in and keeps viewing the engine.
    with torch.no_grad():
        model[0].weight.data = torch.ones_like(model[0].weight)
        reference[0].weight.data = torch.ones_like(reference[0].weight)
    run(model, opt, 2, first=5)
    run(reference, ropt, 2, first=5)
    assert close(model, reference) < 1e-6


@pytest.mark.parametrize("max_norm", [1e-3, 1e9])  # Clipping; not (multiplying by 1).
def test_clipping_outside_the_optimizer_is_exact(max_norm, updates_ahead):
    model, opt, reference, ropt = twin(speculative_updates=True)
    updates_ahead.watch(opt)  # Each clip comes after an update has started.
    for m, o in ((model, opt), (reference, ropt)):
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            ((m(torch.randn(4, 8, generator=g)) - 1) ** 2).mean().backward()
            nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            o.step()
            o.zero_grad()
    assert close(model, reference) < 1e-6
    # Redone only where the clip changed the gradients after the updates had started.
    assert (opt.metrics()["rolled_back_updates"] > 0) == (max_norm < 1)

def test_gradient_accumulation_counts_must_match():
    model, opt, _, _ = twin(gradient_accumulation_steps=4)
    x = torch.randn(4, 8)
    for _ in range(3):
        model(x).sum().backward()
    with pytest.raises(RuntimeError, match="after 3 backward passes.*gradient_accumulation_steps=4"):
        opt.step()
    model(x).sum().backward()
    opt.step()  # The fourth backward completes the step.
    opt.zero_grad()
    for _ in range(4):
        model(x).sum().backward()
    with pytest.raises(RuntimeError, match="5 times since the last step"):
        model(x).sum().backward()


def test_step_before_backward_and_state_access_mid_step_are_errors():
    model, opt, _, _ = twin()
    with pytest.raises(RuntimeError, match="before any backward"):
        opt.step()
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="between backward\\(\\) and step\\(\\)"):
        opt.state_dict()
    opt.step()
    assert opt.state_dict()["state"][0]["step"].item() == 1


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda m: st.OffloadAdamW([m[0].weight, m[0].weight]), ValueError, "twice"),
        (lambda m: st.OffloadAdamW([{"params": [m[0].weight]}, {"params": [m[0].weight]}]),
         ValueError, "more than one"),
        (lambda m: st.OffloadAdamW([m[0].weight, nn.Parameter(torch.zeros(3, device="meta"))]),
         ValueError, "one optimizer drives one device"),
        (lambda m: st.OffloadAdamW([nn.Parameter(torch.zeros(3, device="meta"))]), ValueError,
         "parameters on cpu or cuda only"),
        (lambda m: st.OffloadAdamW([m[0].weight, nn.Parameter(torch.zeros(3).double())]),
         ValueError, "float32, bfloat16 or float16"),
        (lambda m: st.OffloadAdamW([m[0].weight, m[2].weight.detach().bfloat16()]), ValueError,
         "one working dtype"),
        (lambda m: st.OffloadAdamW(m.parameters(), offload="nvme"), ValueError, "nvme_path"),
        (lambda m: st.OffloadAdamW(m.parameters(), offload="nvme", nvme_path="/nonexistent/x"),
         FileNotFoundError, "not a directory"),
        (lambda m: st.OffloadAdamW(nn.Linear(1024, 1024).parameters(), host_memory="2MiB",
                                   config={"host": {"buffer_size": "64KiB"}}),
         MemoryError, "host"),
        (lambda m: st.OffloadAdamW(m.parameters(), host_memory="4KiB"), ValueError,
         "smaller than one staging buffer"),
        (lambda m: st.OffloadAdamW(m.parameters(), amsgrad=True), NotImplementedError, "amsgrad"),
        (lambda m: st.OffloadAdamW(m.parameters(), gradient_accumulation_steps=0), ValueError,
         "gradient_accumulation_steps"),
        (lambda m: st.OffloadAdamW(m.parameters(), config={"placement": {"chunk_bytes": 7}}),
         ValueError, "chunk_bytes"),
        (lambda m: st.OffloadAdamW([{"params": [m[0].weight], "betas": (0.8, 0.9)},
                                    {"params": [m[2].weight]}]), NotImplementedError, "betas"),
    ],
)
def test_bad_construction_says_what_is_wrong(make, error, message):
    with pytest.raises(error, match=message):
        make(mlp())


def test_parameter_groups_cannot_be_added_later():
    model = mlp()
    opt = st.OffloadAdamW([model[0].weight])
    with pytest.raises(NotImplementedError, match="constructor"):
        opt.add_param_group({"params": [model[2].weight]})


@pytest.mark.parametrize("ours, theirs, kwargs", [
    (st.OffloadAdam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05}),
    (st.OffloadAdagrad, torch.optim.Adagrad, {"lr": 5e-2, "weight_decay": 0.01}),
])
def test_the_other_rules_match_their_torch_optimizers(ours, theirs, kwargs):
    model, reference = mlp(), mlp()
    opt, ropt = ours(model.parameters(), **kwargs), theirs(reference.parameters(), **kwargs)
    run(model, opt, 10)
    run(reference, ropt, 10)
    assert close(model, reference) < 1e-6
    ropt.load_state_dict(opt.state_dict())  # State names and groups are torch's.


def test_lion_descends():
    model = mlp()
    opt = st.OffloadLion(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    losses = []
    for _ in range(20):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    assert set(opt.state_dict()["state"][0]) == {"step", "exp_avg"}


def test_fp16_scales_the_loss_and_skips_overflowing_steps():
    model = mlp().half()
    opt = st.OffloadAdamW(model.parameters(), lr=1e-3, loss_scale="dynamic")
    scale = opt.loss_scale
    assert scale == 2.0 ** 16
    x = torch.randn(4, 8).half()
    opt.scale(model(x).float().pow(2).mean()).backward()
    opt.step()
    assert not opt.last_step["skipped"]
    opt.zero_grad()
    # A loss whose scaled gradients overflow fp16: the step is skipped, nothing moves.
    before = [p.detach().clone() for p in model.parameters()]
    opt.scale(model(x).float().pow(2).mean() * 1e6).backward()
    opt.step()
    assert opt.last_step["skipped"] and math.isnan(opt.last_step["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.metrics()["skipped_steps"] == 1 and opt.metrics()["steps"] == 1


def test_metrics_count_what_moved(tmp_path):
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), offload="nvme", nvme_path=str(tmp_path))
    run(model, opt, 3)
    metrics = opt.metrics()
    assert metrics["steps"] == 3 and metrics["iterations"] == 3
    assert metrics["nvme_write_bytes"] > 0 and metrics["optimizer_params"] > 0
    assert metrics["grad_norm"] > 0
    assert "strata_" in opt.metrics_text()


def test_cpu_tensors_are_updated_in_place():
    # Zero copy: gradients are read where the hooks placed them and the updates write the new
    # parameters into the tensors themselves; only an update that finds its chunk not yet handed
    # back by the hooks goes through a copy. Which of the two an update takes is a race with the
    # hook (on a loaded machine most updates may win it), so what is asserted is that gradients
    # never move and that not every update was copied.
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), offload="cpu", chunk_size="64KiB")
    steps = 20
    run(model, opt, steps)
    metrics = opt.metrics()
    numel = sum(p.numel() for p in model.parameters())
    chunk_bytes = 4 * math.ceil(numel / 1024) * 1024  # One chunk, padded to 1024 elements.
    assert metrics["device_to_host_bytes"] == 0
    assert metrics["host_to_device_bytes"] < steps * chunk_bytes


def test_an_nvme_path_too_small_for_the_states_is_a_memory_error(tmp_path):
    # A 1 MiB tmpfs for 12 MiB of states (a 1024 x 1024 layer). Mounting needs root.
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(MemoryError, match="nvme") as error:
            st.OffloadAdamW(nn.Linear(1024, 1024).parameters(), offload="nvme",
                            nvme_path=str(small))
        print(error.value)
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_states_kept_partly_or_wholly_on_the_device_train_alike():
    # DeepSpeed's offload_optimizer.ratio: the first chunks' states stay on the device (here
    # HostDevice, whose optimizer steps run on its compute stream). Every placement gives the
    # same bits as states in host memory.
    def train(offload, ratio):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        opt = st.OffloadAdamW(model.parameters(), lr=1e-2, offload=offload,
                              offload_ratio=ratio, chunk_size="16KiB")
        homes = [opt._native.chunk(c)[5] for c in range(opt._native.chunk_count)]
        for step in range(5):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], set(homes)

    host, homes = train("cpu", 1.0)
    assert homes == {"host"}
    half, homes = train("cpu", 0.5)
    assert homes == {"device", "host"}
    device, homes = train(None, 1.0)
    assert homes == {"device"}
    assert all(torch.equal(a, b) for a, b in zip(host, half))
    assert all(torch.equal(a, b) for a, b in zip(host, device))


@pytest.mark.parametrize("offload, ratio", [(None, 1.0), ("cpu", 0.5)])
def test_cpu_tensors_get_device_memory_for_the_states_kept_there(offload, ratio):
    # 4M parameters: 48 MiB of states, more than the staging room alone would give.
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048))
    opt = st.OffloadAdamW(model.parameters(), offload=offload, offload_ratio=ratio,
                          chunk_size="4MiB")
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    metrics = opt.metrics()
    assert metrics["device_peak_bytes"] <= metrics["device_budget_bytes"]


def test_a_compiled_model_trains_as_the_eager_one():
    # torch.compile traces the parameters (views of the engine's chunks) as its inputs; the
    # gradient hooks still fire per parameter. aot_eager: dynamo and AOT autograd, no C++.
    model, reference = training.make_model("mlp"), training.make_model("mlp")
    opt = st.OffloadAdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(5):
        x, y = training.batch("mlp", step, 0)
        ((compiled(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        ropt.step()
        ropt.zero_grad()
    assert close(model, reference) < 1e-6


def test_bench_adam_times_the_kernel_and_its_roofline():
    import strata

    result = strata.bench_adam(1 << 16, threads=1, runs=1)
    assert result["bytes_per_param"] == 28  # fp32 AdamW: p, g, m, v read; p, m, v written.
    assert result["threads"] == 1
    assert result["step_seconds"] > 0 and result["roofline_seconds"] > 0
    with pytest.raises(ValueError, match="numel"):
        strata.bench_adam(0)
