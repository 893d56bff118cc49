"""Paths a training loop takes besides the plain one, from a review as a trainer author: each
either matches torch.optim or raises a clear error that leaves the optimizer usable."""

import gc
import re
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from torch import nn

import strata.torch as st
import training


def mlp(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])


def backward(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 8, generator=g).to(next(model.parameters()).dtype)).float().pow(
        2).mean().backward()


class FailsOnce:
    """Wraps an engine so that its first step() fails (an NVMe write error, say) before the
    engine steps, as a real failure leaves it: the next step() retries."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        self.calls += 1
        if self.calls == 1:
            raise OSError("simulated NVMe write error")
        return self.engine.step()


def test_a_discarded_backward_is_forgotten_when_nothing_was_handed_over():
    # overlap=False (or a backward that completed no chunk): zero_grad() discards it, as torch.
    model, reference = mlp(), mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1, overlap=False)
    ropt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    for m, o in ((model, opt), (reference, ropt)):
        backward(m, 1)
        o.zero_grad()  # A bad batch, skipped.
        backward(m, 2)
        o.step()
        o.zero_grad()
    assert training.relative_difference(model, reference) < 1e-6


def test_zero_grad_after_chunks_started_updating_discards_the_step_as_torch_does():
    runs = []
    for make in (lambda p: st.OffloadAdamW(p, lr=0.1), lambda p: torch.optim.AdamW(p, lr=0.1)):
        model = mlp()
        opt = make(model.parameters())
        backward(model)
        opt.step()  # From the second step on, chunks go to the engine during backward.
        opt.zero_grad()
        backward(model, 1)
        opt.zero_grad()  # Dropped, with what the engine had done for it.
        backward(model, 3)
        opt.step()
        runs.append(model)
    assert training.relative_difference(*runs) < 1e-6
    assert opt.state[next(iter(runs[1].parameters()))]["step"] == 2


def test_a_short_accumulation_can_be_discarded_or_completed():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1, gradient_accumulation_steps=2)
    backward(model)
    with pytest.raises(RuntimeError, match="after 1 backward passes"):
        opt.step()
    opt.zero_grad()  # The end of an epoch: drop the partial accumulation.
    backward(model, 1)
    backward(model, 2)
    opt.step()
    assert opt.last_step["step"] == 1


def test_an_error_inside_the_hook_leaves_the_counts_as_they_were():
    model = nn.Embedding(10, 4, sparse=True)
    opt = st.OffloadAdamW(model.parameters(), lr=0.1, overlap=False)
    with pytest.raises(RuntimeError, match="sparse gradients"):
        model(torch.tensor([1, 2])).sum().backward()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="before any backward"):
        opt.step()


def test_a_parameter_without_a_gradient_is_left_alone_as_torch_does():
    model, reference = mlp(), mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1, chunk_size="1MiB")  # One chunk for all.
    ropt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    for m, o in ((model, opt), (reference, ropt)):
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            # After step 0 only the first layer's bias is used... and the first layer's weight.
            (m(x) if step == 0 else m[0](x)).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    assert model[1].weight.grad is None
    assert training.relative_difference(model, reference) < 1e-6


def test_changing_requires_grad_after_construction_is_refused():
    model = mlp()
    model[0].requires_grad_(False)
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)
    model[0].requires_grad_(True)
    with pytest.raises(NotImplementedError, match="requires_grad"):
        backward(model)


def test_bf16_masters_survive_an_in_place_write_of_the_same_values():
    def train(swap: bool):
        model = mlp().to(torch.bfloat16)
        opt = st.OffloadAdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            backward(model, step)
            opt.step()
            opt.zero_grad()
            if swap:  # EMA-style swap out and back under no_grad: the same values.
                with torch.no_grad():
                    saved = [p.clone() for p in model.parameters()]
                    for p in model.parameters():
                        p.zero_()
                    for p, s in zip(model.parameters(), saved):
                        p.copy_(s)
        return opt.state_dict()["state"]

    plain, swapped = train(False), train(True)
    for i in plain:
        assert torch.equal(plain[i]["master"], swapped[i]["master"])


def test_writes_through_data_are_adopted_by_sync_parameters():
    model, reference = mlp(), mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)
    ropt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    for m, o in ((model, opt), (reference, ropt)):
        backward(m)
        o.step()
        o.zero_grad()
        for p in m.parameters():
            p.data.clamp_(-0.01, 0.01)  # WGAN's weight clipping: invisible to autograd.
    opt.sync_parameters()
    for m, o in ((model, opt), (reference, ropt)):
        backward(m, 1)
        o.step()
    assert training.relative_difference(model, reference) < 1e-6


def test_a_failed_engine_step_is_retried_by_the_next_step():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)

    opt._native.raw = FailsOnce(opt._native.raw)
    backward(model)
    with pytest.raises(OSError, match="simulated"):
        opt.step()
    opt.step()  # The retry: the same step, finished once.
    assert opt._native.raw.calls == 2 and opt.last_step["step"] == 1
    opt.zero_grad()
    backward(model, 1)
    opt.step()
    assert opt.last_step["step"] == 2


def test_an_optimizer_left_hooked_names_close_and_close_hands_the_parameters_over():
    # An OffloadAdamW kept alive by its LR scheduler while torch's AdamW trains its parameters:
    # its hooks still count backward passes, and the error says to close it.
    # (A count given: with "auto" and no overlap, an old optimizer's hooks count on harmlessly.)
    model = mlp()
    first = st.OffloadAdamW(model.parameters(), lr=0.1, overlap=False,
                            gradient_accumulation_steps=1)
    scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=1)
    backward(model)
    first.step()
    first.zero_grad()
    scheduler.step()
    second = torch.optim.AdamW(model.parameters(), lr=0.1)
    backward(model, 1)
    second.step()
    second.zero_grad()
    with pytest.raises(RuntimeError, match=re.escape("call its close() first")):
        backward(model, 2)

    # Closed first, it lets go: the values stay, torch trains them, the old one refuses calls.
    model = mlp()
    first = st.OffloadAdamW(model.parameters(), lr=0.1, gradient_accumulation_steps=1)
    scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=1)
    backward(model)
    first.step()
    first.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    backward(model, 1)  # Every chunk goes to the engine, updating...
    first.close()  # ...and close() drops that step: the parameters stay as they were.
    first.close()  # Again: nothing.
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(RuntimeError, match=re.escape("close() was called")):
        first.step()
    second = torch.optim.AdamW(model.parameters(), lr=0.1)
    for seed in range(3):
        backward(model, seed)
        second.step()
        second.zero_grad()
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16])
def test_a_model_cast_after_the_optimizer_is_refused_not_reverted(cast):
    # model.to(dtype) after building the optimizer: the first backward says what to do, and
    # the parameters stay as the user cast them (no silent revert to fp32).
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)
    model.to(cast)
    with pytest.raises(RuntimeError, match="Cast or move the model first"):
        backward(model)
    assert all(p.dtype == cast for p in model.parameters())
    model.float()  # Cast back: the optimizer goes on, with the values as they are now.
    opt.zero_grad()
    backward(model)
    opt.step()
    assert opt.last_step["step"] == 1


def test_a_new_optimizer_on_the_same_parameters_takes_them_over():
    # `opt = st.OffloadAdamW(...)` again (after freezing a layer, say) while the old one lives.
    model = mlp()
    first = st.OffloadAdamW(model.parameters(), lr=0.1)
    with pytest.raises(ValueError):
        st.OffloadAdamW(model.parameters(), lr=0.1, offload="bogus")  # Fails: nothing changes.
    backward(model)
    first.step()
    first.zero_grad()
    second = st.OffloadAdamW(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="taken over"):
        first.step()
    backward(model, 1)
    second.step()
    assert second.last_step["step"] == 1


def test_deleting_the_optimizer_frees_the_engine_and_keeps_the_parameters():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)
    backward(model)
    opt.step()
    values = [p.detach().clone() for p in model.parameters()]
    engine = weakref.ref(opt._native.raw)
    del opt
    gc.collect()
    assert engine() is None, "the parameters no longer hold the engine"
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values))
    backward(model, 1)  # The model trains on (no hooks left).


@pytest.mark.parametrize("layout", ["resident", "offloaded", "mirrored"])
def test_the_engine_goes_with_its_optimizer_without_a_garbage_collection(layout, tmp_path):
    # Nothing of an optimizer refers back to it or to itself in a cycle: at the last reference's
    # end its engine is freed (and its NVMe swap files with it) at once, as at interpreter exit,
    # where cycles may never be collected.
    model = mlp()
    if layout == "offloaded":
        st.offload_parameters(model, "cpu")
    if layout == "mirrored":  # One rank of shard_states: the mirrored layout.
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        opt = st.OffloadAdamW(model.parameters(), lr=0.1, shard_states=layout == "mirrored",
                              offload="nvme", nvme_path=tmp_path)
        backward(model)
        opt.step()
        opt.state_dict() if layout != "mirrored" else opt.consolidate_state_dict()
        engine = weakref.ref(opt._native.raw)
        gc.disable()
        try:
            del opt
            assert engine() is None, "the optimizer's parts hold each other in a cycle"
        finally:
            gc.enable()
        assert not list(tmp_path.glob("strata-swap-*")), "the swap files go with the engine"
    finally:
        if layout == "mirrored":
            torch.distributed.destroy_process_group()


def test_parameters_stay_valid_in_exit_handlers_registered_before_the_import():
    script = textwrap.dedent("""
        import atexit, torch
        from torch import nn
        model = nn.Linear(2048, 2048)
        def at_exit():
            model.weight.data.add_(1)  # Writes: freed memory would crash here.
            print("at exit", float(model.weight.detach().sum()), flush=True)
        atexit.register(at_exit)
        import strata.torch as st
        opt = st.OffloadAdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 2048)).sum().backward()
        opt.step()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "at exit" in result.stdout


def test_loading_settings_the_engine_cannot_honour_is_refused():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)
    backward(model)
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][0]["amsgrad"] = True
    with pytest.raises(NotImplementedError, match="amsgrad"):
        opt.load_state_dict(saved)
    # An empty state (a fresh torch optimizer's) resets moments and the step count, as in torch.
    fresh = torch.optim.AdamW(mlp().parameters(), lr=0.1).state_dict()
    opt.load_state_dict(fresh)
    # Every trained parameter's state stays listed (what torch.distributed.checkpoint loads
    # into), at step 0 with zero moments: where torch AdamW's first step starts.
    state = opt.state_dict()["state"]
    assert len(state) == sum(p.requires_grad for p in model.parameters())
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
               for s in state.values())
    opt.zero_grad()
    backward(model, 1)
    opt.step()
    assert opt.last_step["step"] == 1


@pytest.mark.parametrize("config", [
    {"optimizer": {"gradient_accumulation_steps": 2}},
    {"optimizer": {"delayed_update": True}},
    {"placement": {"params": "host"}},
])
def test_config_keys_the_optimizer_sets_itself_are_refused(config):
    with pytest.raises(ValueError, match="set by OffloadAdamW"):
        st.OffloadAdamW(mlp().parameters(), config=config)


def test_reentrant_checkpointing_is_named_in_the_double_gradient_error():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1, gradient_accumulation_steps=1)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        h = torch.utils.checkpoint.checkpoint(model[0], x, use_reentrant=True)
        (model[0](h) + model[1](h)).sum().backward()


def test_an_interrupt_after_the_engine_finished_the_step_loses_nothing():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)

    class InterruptedAfter:
        def __init__(self, engine):
            self.engine = engine

        def __getattr__(self, name):
            return getattr(self.engine, name)

        def step(self):
            self.engine.step()
            raise KeyboardInterrupt  # Ctrl-C just as the call returns.

    real = opt._native.raw
    opt._native.raw = InterruptedAfter(real)
    backward(model)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    opt._native.raw = real
    opt.zero_grad()
    backward(model, 1)
    opt.step()
    assert opt.last_step["step"] == 2


def test_unused_parameters_with_zeroed_gradients_are_updated_as_torch_does():
    # zero_grad(set_to_none=False): an unused parameter keeps a zero .grad, and torch updates
    # it (momentum, weight decay).
    model, reference = mlp(), mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1, chunk_size="1MiB")
    ropt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    for m, o in ((model, opt), (reference, ropt)):
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            (m(x) if step == 0 else m[0](x)).pow(2).mean().backward()
            o.step()
            o.zero_grad(set_to_none=False)
    assert training.relative_difference(model, reference) < 1e-6


def test_a_write_between_backward_and_step_to_a_chunk_without_gradients_is_kept():
    # a and u share a chunk; u gets no gradient, so its states are put back after the step.
    # b (a chunk of its own) gets none either and is written meanwhile: the write must stay.
    torch.manual_seed(0)
    a, u, b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(64, 64)
    opt = st.OffloadAdamW([*a.parameters(), *u.parameters(), *b.parameters()], lr=0.1,
                          chunk_size="4KiB")
    assert opt._table.chunk_of(0) == opt._table.chunk_of(2) != opt._table.chunk_of(4)
    a(torch.randn(4, 8)).sum().backward()
    with torch.no_grad():
        b.weight.fill_(0.5)
    opt.step()
    opt.zero_grad()
    (a(torch.randn(4, 8)).sum() + b(torch.randn(4, 64)).sum()).backward()
    opt.step()
    assert abs(b.weight.mean().item() - 0.5) < 0.2  # Moved by one step of lr 0.1, not reset.


def test_exit_handlers_may_touch_tensors_that_view_the_parameters():
    script = textwrap.dedent("""
        import atexit, torch
        from torch import nn
        model = nn.Linear(2048, 2048)
        holder = {}
        def at_exit():
            holder["best"]["weight"].add_(1)  # A state_dict snapshot: views of the parameters.
            print("at exit", float(holder["best"]["weight"].sum()), flush=True)
        atexit.register(at_exit)
        import strata.torch as st
        opt = st.OffloadAdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 2048)).sum().backward()
        opt.step()
        holder["best"] = model.state_dict()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "at exit" in result.stdout


def test_a_retry_pending_says_so():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)

    opt._native.raw = FailsOnce(opt._native.raw)
    backward(model)
    with pytest.raises(OSError):
        opt.step()
    with pytest.raises(RuntimeError, match="retry"):
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="retry"):
        backward(model, 1)
    with pytest.raises(RuntimeError, match="retry"):
        opt.step(lambda: 0.0)
    opt.step()
    assert opt.last_step["step"] == 1


def test_config_may_set_device_options_the_optimizer_does_not():
    opt = st.OffloadAdam(mlp().parameters(), config={"device": {"copy_bandwidth_gbps": 50.0}})
    assert opt.loss_scale == 1.0
    with pytest.raises(ValueError, match="set by OffloadAdam "):
        st.OffloadAdam(mlp().parameters(), config={"device": {"kind": "cuda"}})


def test_a_bad_entry_in_a_state_dict_loads_nothing():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)
    backward(model)
    opt.step()
    opt.zero_grad()
    before = opt.state_dict()
    bad = opt.state_dict()
    for entry in bad["state"].values():
        entry["exp_avg"] = entry["exp_avg"] * 0 + 7
    bad["state"][2]["exp_avg_sq"] = torch.zeros(3)
    with pytest.raises(ValueError, match="parameter 2"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert all(torch.equal(before["state"][i][k], after["state"][i][k])
               for i in before["state"] for k in before["state"][i])
    unknown = opt.state_dict()
    unknown["state"][99] = unknown["state"][0]
    with pytest.raises(ValueError, match="99"):
        opt.load_state_dict(unknown)


def test_a_step_whose_gradients_were_all_set_to_none_does_nothing_as_in_torch():
    # model.zero_grad() after backward (every chunk with the engine, updating), then step():
    # torch skips every parameter; so does the optimizer, and it goes on.
    runs = []
    for make in (lambda p: st.OffloadAdamW(p, lr=0.1), lambda p: torch.optim.AdamW(p, lr=0.1)):
        model = mlp()
        opt = make(model.parameters())
        backward(model)
        opt.step()
        opt.zero_grad()
        backward(model, 1)  # From the second step on, chunks go to the engine during backward.
        model.zero_grad()
        opt.step()
        opt.zero_grad()
        backward(model, 2)
        opt.step()
        runs.append(model)
    assert training.relative_difference(*runs) < 1e-6


def test_a_backward_after_gradients_set_to_none_restarts_an_explicit_count():
    # gradient_accumulation_steps=1, a parameter no backward reaches (its chunk never completes
    # during backward), and a step the loop skipped by setting every .grad to None
    # (model.zero_grad(), as after a skipped GradScaler step): the next backward is the first
    # of its step, as in torch.
    def net():
        torch.manual_seed(0)
        return nn.ModuleDict({"used": nn.Linear(8, 8), "unused": nn.Linear(8, 8)})

    runs = []
    for make in (lambda p: st.OffloadAdamW(p, lr=0.1, gradient_accumulation_steps=1),
                 lambda p: torch.optim.AdamW(p, lr=0.1)):
        model = net()
        opt = make(model.parameters())
        for seed in range(3):
            model["used"](torch.randn(4, 8)).pow(2).mean().backward()
            if seed == 1:
                model.zero_grad()  # Skipped.
                continue
            opt.step()
            opt.zero_grad()
        runs.append(model)
    assert training.relative_difference(*runs) < 1e-6


class FailsToPutStatesBack:
    """Wraps an engine so that writing states fails (as a full NVMe write would) once the
    engine's step has completed: what step() does after the engine's step then raises."""

    def __init__(self, engine):
        self.engine, self.stepped = engine, False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        report = self.engine.step()
        self.stepped = True
        return report

    def write_states(self, batch):
        if self.stepped:
            raise OSError("simulated write error")
        return self.engine.write_states(batch)


def test_a_step_that_raises_after_the_engine_stepped_still_reports_it():
    # a and u share a chunk; u gets no gradient, so its states are put back after the step:
    # that write fails, after the engine completed the step.
    a, u = nn.Linear(8, 8), nn.Linear(8, 8)
    opt = st.OffloadAdamW([*a.parameters(), *u.parameters()], lr=0.1)
    assert opt._table.chunk_of(0) == opt._table.chunk_of(2)
    a(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    first = opt.last_step
    opt._native.raw = FailsToPutStatesBack(opt._native.raw)
    a(torch.randn(4, 8)).sum().backward()
    with pytest.raises(OSError, match="simulated"):
        opt.step()
    assert opt.last_step is not first and opt.last_step["step"] == 2
    assert opt.metrics()["steps"] == 2


def test_settings_fixed_at_construction_refuse_a_change():
    opt = st.OffloadAdamW(mlp().parameters(), lr=0.1, max_grad_norm=1.0,
                          gradient_accumulation_steps=2, overlap=False)
    assert (opt.max_grad_norm, opt.gradient_accumulation_steps, opt.overlap) == (1.0, 2, False)
    for name, value in (("max_grad_norm", 0.5), ("gradient_accumulation_steps", 4),
                        ("overlap", True)):
        with pytest.raises(AttributeError, match=f"{name} is fixed at construction"):
            setattr(opt, name, value)
    assert (opt.max_grad_norm, opt.gradient_accumulation_steps, opt.overlap) == (1.0, 2, False)


def test_param_groups_replaced_by_the_same_groups_keep_following_the_scheduler():
    # accelerate's AcceleratedOptimizer sets the wrapped optimizer's param_groups: the new list
    # is the one a scheduler then changes, and the engine must read it.
    model, reference = mlp(), mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)
    ropt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    for o in (opt, ropt):
        o.param_groups = [dict(g) for g in o.param_groups]
        o.param_groups[0]["lr"] = 0.01
    for step in range(2):
        for m, o in ((model, opt), (reference, ropt)):
            backward(m, step)
            o.step()
            o.zero_grad()
    assert training.relative_difference(model, reference) < 1e-6


def test_param_groups_replaced_by_other_parameters_are_refused():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="the parameters it was built with"):
        opt.param_groups = [{**opt.param_groups[0], "params": [nn.Parameter(torch.ones(2))]}]
    with pytest.raises(ValueError, match="the parameters it was built with"):
        opt.param_groups = opt.param_groups + opt.param_groups


def test_a_state_view_of_a_collected_optimizer_says_so():
    model = mlp()
    opt = st.OffloadAdamW(model.parameters(), lr=0.1)
    view, weight = opt.state, next(model.parameters())
    assert weight in view
    del opt
    gc.collect()
    with pytest.raises(RuntimeError, match="the optimizer of this state view is gone"):
        weight in view  # noqa: B015 (the membership test is what is tested)
    with pytest.raises(RuntimeError, match="the optimizer of this state view is gone"):
        len(view)
