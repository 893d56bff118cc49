"""strata.torch.offload_parameters: parameters in host memory or on NVMe between uses, against
torch.optim.AdamW on the same model kept whole (CPU tensors: the engine's host device stands
for the GPU, under a device budget a quarter of the parameters and gradients)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload_models as models
import strata.torch as st

HERE = Path(__file__).parent
STEPS = 30
LR = 3e-3
WEIGHT_DECAY = 0.1
# Clips about half of the steps of either model (the test checks that it does).
CLIP = {"gpt": 6.0, "mlp": 2.3}

# name: (model, activation checkpointing, parameters' home, states' home, micro-steps, clip)
CASES = {
    "gpt_host_clipped": ("gpt", None, "cpu", "cpu", 1, True),
    "gpt_nvme_checkpointed_accumulating": ("gpt", "non_reentrant", "nvme", "nvme", 2, False),
    "gpt_reentrant_states_on_nvme": ("gpt", "reentrant", "cpu", "nvme", 1, True),
    "mlp_shared_layer_on_nvme": ("mlp", None, "nvme", "cpu", 2, True),
}


# Small chunks, so that a quarter of these small models holds several.
CHUNK = 4096


def device_memory_for(model: torch.nn.Module) -> int:
    """A quarter of the parameters and their gradients; for the MLP, whose largest layer is a
    tenth of it, room for four of its largest chunks (what backward holds at once: the shared
    layer's, the one in use, and what comes next)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(CHUNK, max(p.numel() * p.element_size() for p in model.parameters()))
    return max(2 * params // 4, 4 * 2 * largest)


def offloaded(kind: str, checkpointing: str | None, params: str, states: str, gas: int,
              clip: float, tmp_path: Path, dtype: torch.dtype = torch.float32):
    model = models.make(kind, checkpointing, dtype)
    device_memory = device_memory_for(model)
    tmp_path.mkdir(exist_ok=True)
    st.offload_parameters(model, params, nvme_path=tmp_path if params == "nvme" else None,
                          device_memory=device_memory)
    opt = st.OffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, offload=states,
                          nvme_path=tmp_path if "nvme" in (params, states) else None,
                          max_grad_norm=clip, gradient_accumulation_steps=gas, chunk_size=CHUNK)
    return model, opt, device_memory


def reference(kind: str, checkpointing: str | None, steps: int, gas: int, clip: float):
    model = models.make(kind, checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = models.train(kind, model, opt, range(steps), gas=gas, clip=clip)
    return model, losses


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("case", CASES)
def test_matches_torch_adamw_within_a_quarter_of_the_memory(case, tmp_path):
    kind, checkpointing, params, states, gas, clipped = CASES[case]
    clip = CLIP[kind] if clipped else 0.0
    ref, ref_losses = reference(kind, checkpointing, STEPS, gas, clip)
    model, opt, device_memory = offloaded(kind, checkpointing, params, states, gas, clip, tmp_path)
    norms = []
    losses = []
    for step in range(STEPS):
        losses += models.train(kind, model, opt, range(step, step + 1), gas=gas)
        norms.append(opt.last_step["grad_norm"])

    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert max_difference(model.state_dict(), ref.state_dict()) <= 1e-4
    if clip:
        assert 0 < sum(n > clip for n in norms) < STEPS, norms
    m = opt.metrics()
    assert 0 < m["device_peak_bytes"] <= device_memory
    if kind == "gpt":  # Parameters and gradients 4x the device's budget.
        assert device_memory == 2 * sum(p.numel() * 4 for p in model.parameters()) // 4
    assert m["evictions"] > 0 and m["fetches"] > 0
    fetched = m["fetched_from_nvme_bytes"] if params == "nvme" else m["fetched_from_host_bytes"]
    assert fetched > 0
    assert m["filled_param_bytes"] == 0  # Nothing stays filled between steps.
    assert "strata_param_fetch_bytes_total" in opt.metrics_text()


def test_bf16_parameters_train_as_when_resident(tmp_path):
    """Offloading changes where the bf16 parameters live, not one bit of what is computed."""
    resident = models.make("gpt", None, torch.bfloat16)
    resident_opt = st.OffloadAdamW(resident.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                   max_grad_norm=CLIP["gpt"], chunk_size=CHUNK)
    expected = models.train("gpt", resident, resident_opt, range(10), dtype=torch.bfloat16)
    model, opt, _ = offloaded("gpt", "non_reentrant", "nvme", "cpu", 1, CLIP["gpt"], tmp_path,
                              torch.bfloat16)
    losses = models.train("gpt", model, opt, range(10), dtype=torch.bfloat16)
    assert losses == expected
    assert max_difference(model.state_dict(), resident.state_dict()) == 0.0
    assert opt.state_dict()["state"].keys() == resident_opt.state_dict()["state"].keys()


def test_inference_and_a_loaded_model_use_the_engines_values(tmp_path):
    ref, _ = reference("gpt", None, 5, 1, 0.0)
    model, opt, _ = offloaded("gpt", None, "cpu", "cpu", 1, 0.0, tmp_path)
    x, _ = models.batch("gpt", 99, 0)
    # model.load_state_dict writes every parameter's master; no_grad forward reads them back.
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    # And training goes on from the loaded values as torch's would.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    expected = models.train("gpt", ref, ref_opt, range(5, 8))
    losses = models.train("gpt", model, opt, range(5, 8))
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-5


def test_checkpoint_round_trip_in_a_new_process(tmp_path):
    """model.state_dict() + the optimizer's state_dict(), saved half-way and loaded by a fresh
    process with offloaded parameters, continue as the uninterrupted run."""
    ref, ref_losses = reference("gpt", None, STEPS, 1, CLIP["gpt"])
    model, opt, _ = offloaded("gpt", None, "nvme", "nvme", 1, CLIP["gpt"], tmp_path / "a")
    half = STEPS // 2
    models.train("gpt", model, opt, range(half))
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint)
    out = tmp_path / "params.pt"
    (tmp_path / "b").mkdir()
    subprocess.run([sys.executable, str(HERE / "param_offload_resume.py"), str(checkpoint),
                    str(tmp_path / "b"), str(half), str(STEPS), str(CLIP["gpt"]), str(out)],
                   check=True, timeout=600)
    resumed = torch.load(out)
    assert max(abs(a - b) for a, b in zip(resumed["losses"], ref_losses[half:])) <= 1e-5
    assert max_difference(resumed["model"], ref.state_dict()) <= 1e-4


def test_reads_outside_a_module_and_offloaded_gradients_raise_clear_errors(tmp_path):
    model, opt, _ = offloaded("mlp", None, "cpu", "cpu", 1, 0.0, tmp_path)
    with pytest.raises(RuntimeError, match="offloaded by strata.torch.offload_parameters"):
        model.out.weight.sum()
    assert model.out.weight.shape == (8, 64)  # Names and shapes stay.
    assert [n for n, _ in model.named_parameters()][:4] == [
        "inp.weight", "inp.bias", "shared.weight", "shared.bias"]
    models.loss_of("mlp", model, 0, 0).backward()
    # The user's own clip would otherwise skip gradients that already left the device.
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="zero_grad.. after backward"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    # A second forward before step() with gradient_accumulation_steps 1.
    models.loss_of("mlp", model, 1, 0).backward()
    with pytest.raises(RuntimeError, match="after 1 backward passes without step"):
        models.loss_of("mlp", model, 1, 1)
    opt.step()
    # And step() after fewer backward passes than declared.
    model, opt, _ = offloaded("mlp", None, "cpu", "cpu", 2, 0.0, tmp_path)
    models.loss_of("mlp", model, 0, 0).backward()
    with pytest.raises(RuntimeError, match="step.. after 1 backward passes"):
        opt.step()


def test_a_trained_parameter_without_a_gradient_is_refused(tmp_path):
    model = models.make("mlp")
    model.unused = torch.nn.Linear(4, 4)  # Never called: its parameters get no gradient.
    st.offload_parameters(model, "cpu")
    opt = st.OffloadAdamW(model.parameters(), lr=LR)
    models.loss_of("mlp", model, 0, 0).backward()
    with pytest.raises(RuntimeError, match="received no gradient"):
        opt.step()
    with pytest.raises(RuntimeError, match="received no gradient"):
        models.loss_of("mlp", model, 1, 0)


def test_an_optimizer_over_part_of_the_model_is_refused():
    model = models.make("mlp")
    st.offload_parameters(model, "cpu")
    with pytest.raises(ValueError, match="not in the model given to offload_parameters"):
        st.OffloadAdamW([*model.parameters(), torch.nn.Parameter(torch.zeros(3))], lr=LR)


def test_closing_gives_the_parameters_back_with_their_trained_values(tmp_path):
    model, opt, _ = offloaded("mlp", None, "cpu", "cpu", 1, 0.0, tmp_path)
    models.train("mlp", model, opt, range(3))
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()
    assert max_difference(dict(model.named_parameters()), trained) == 0.0
    models.loss_of("mlp", model, 0, 0).backward()  # Plain torch again.
    assert model.out.weight.grad is not None
