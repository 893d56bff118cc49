"""strata.torch.initialize with DeepSpeed's ZeRO-3 offload configs: DeepSpeed's loop
(engine(batch), engine.backward(loss), engine.step()) against the plain torch loop with
torch.optim.AdamW and the config's hyper-parameters, and the config errors
`strata config check` gives."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import types
from pathlib import Path

import pytest
import torch

import offload_models as models
import strata
import strata.torch as st

STEPS = 12
HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "python" / "train_gpt.py"
# DeepSpeed's ZeRO-Infinity example (docs), as the config parser's tests and fuzzer use it.
ZERO_INFINITY = HERE.parent / "fuzz" / "corpus" / "config" / "zero_infinity_config.json"
MICRO = 2  # Micro-batches per step (gradient_accumulation_steps).


def zero3_config(tmp_path: Path, params: str, states: str) -> dict:
    """DeepSpeed's ZeRO-3 offload example (docs: "ZeRO-Infinity"), fp32, small buffers."""
    def offload(device: str, **extra) -> dict:
        section = {"device": device, "pin_memory": True, **extra}
        if device == "nvme":
            section["nvme_path"] = str(tmp_path)
        return section
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": MICRO,
        "gradient_clipping": 6.0,
        "steps_per_print": 10,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                 "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_max_live_parameters": 1e9,
            "stage3_prefetch_bucket_size": 1e7,
            "stage3_param_persistence_threshold": 1e5,
            "offload_optimizer": offload(states, buffer_count=4),
            # max_in_cpu 0: every parameter on NVMe (DeepSpeed keeps 1e9 in host memory).
            "offload_param": offload(params, buffer_count=5, buffer_size=1e6,
                                     **({"max_in_cpu": 0} if params == "nvme" else {})),
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False,
                "overlap_events": True, "thread_count": 1},
    }


def deepspeed_loop(engine: st.ModelEngine, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(MICRO):
            loss = models.loss_of("gpt", engine, step, micro)
            engine.backward(loss)
            engine.step()
            total += loss.item() / MICRO
        losses.append(total)
    return losses


def torch_reference(steps: int) -> tuple[torch.nn.Module, list[float]]:
    model = models.make("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    return model, models.train("gpt", model, opt, range(steps), gas=MICRO, clip=6.0)


@pytest.mark.parametrize("params,states", [("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme")])
def test_zero3_offload_configs_train_as_torch(tmp_path, params, states):
    reference, expected = torch_reference(STEPS)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(zero3_config(tmp_path, params, states)))
    model = models.make("gpt")
    engine, opt, loader, scheduler = st.initialize(model=model,
                                                   model_parameters=model.parameters(),
                                                   config=str(path))
    assert loader is None and scheduler is None
    assert isinstance(opt, st.OffloadAdamW)
    assert engine.gradient_accumulation_steps() == MICRO
    assert engine.train_micro_batch_size_per_gpu() == 4
    losses = deepspeed_loop(engine, STEPS)
    assert engine.global_steps == STEPS
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-5
    state = model.state_dict()
    assert max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items()) <= 1e-4
    assert engine.get_global_grad_norm() > 0
    fetched = opt.metrics()["fetched_from_nvme_bytes" if params == "nvme"
                            else "fetched_from_host_bytes"]
    assert fetched > 0


def example_gpt() -> type:
    """examples/python/train_gpt.py's GPT."""
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT


def test_the_zero_infinity_example_config_trains_the_example_gpt(tmp_path):
    """DeepSpeed's ZeRO-Infinity example config as it is (fp16 with a dynamic loss scale,
    parameters and states on NVMe, Adam, clipping, 4 micro-batches per step, WarmupLR), its
    NVMe paths pointed at scratch folders, on examples/python/train_gpt.py's GPT."""
    config = json.loads(ZERO_INFINITY.read_text())
    for section in ("offload_optimizer", "offload_param"):
        folder = tmp_path / section
        folder.mkdir()
        config["zero_optimization"][section]["nvme_path"] = str(folder)
    torch.manual_seed(0)
    model = example_gpt()(context=32, width=64, layers=2, heads=4)
    with pytest.raises(NotImplementedError, match="scheduler"):
        st.initialize(model=model, config=config)
    # WarmupLR, built in torch.
    warmup = config["scheduler"]["params"]["warmup_num_steps"]
    engine, opt, _, _ = st.initialize(
        model=model, model_parameters=model.parameters(), config=config,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: math.log(s + 1) / math.log(warmup)))
    assert next(model.parameters()).dtype == torch.float16
    assert isinstance(opt, st.OffloadAdamW)  # DeepSpeed's Adam is AdamW (adam_w_mode).
    assert engine.gradient_accumulation_steps() == 4
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    for _ in range(3 * engine.gradient_accumulation_steps()):
        tokens = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 33), generator=g)
        logits = engine(tokens[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        assert torch.isfinite(loss)
        engine.backward(loss)
        engine.step()
    assert engine.global_steps == 3
    after = model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in ("blocks.0.qkv.weight", "norm.bias"))
    assert opt.loss_scale > 1
    m = opt.metrics()
    assert m["nvme_write_bytes"] > 0  # The states live on NVMe.


def strata_cli() -> Path:
    """The `strata` executable of the build whose extension is on PYTHONPATH."""
    return Path(strata.__file__).resolve().parents[2] / "tools" / "strata"


@pytest.mark.parametrize("mistake", ["typo", "unsupported"])
def test_config_errors_are_strata_config_checks(tmp_path, mistake):
    config = zero3_config(tmp_path, "cpu", "cpu")
    if mistake == "typo":
        config["zero_optimization"]["offload_param"]["pin_memroy"] = True
    else:  # Parameters offloaded while the states stay on the device.
        del config["zero_optimization"]["offload_optimizer"]
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        st.initialize(model=models.make("gpt"), config=str(path))
    if not strata_cli().exists():
        pytest.skip(f"no strata executable at {strata_cli()}")
    check = subprocess.run([str(strata_cli()), "config", "check", str(path)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode != 0
    assert str(error.value) in check.stderr


def test_auto_values_come_from_training_arguments_or_are_refused(tmp_path):
    """What the HF Trainer's DeepSpeed integration writes: "auto" wherever its arguments
    decide."""
    config = zero3_config(tmp_path, "cpu", "cpu")
    config.update({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"})
    config["optimizer"]["params"].update({"lr": "auto", "betas": "auto", "eps": "auto",
                                          "weight_decay": "auto"})
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"
    with pytest.raises(ValueError, match="optimizer.params.lr is \"auto\""):
        st.initialize(model=models.make("gpt"), config=config)
    args = types.SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=MICRO,
                                 max_grad_norm=6.0, learning_rate=3e-3, adam_beta1=0.9,
                                 adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.1,
                                 fp16=False, bf16=False)
    reference, expected = torch_reference(4)
    engine, opt, _, _ = st.initialize(args=args, model=models.make("gpt"), config=config)
    assert engine.train_batch_size() == 4 * MICRO
    losses = deepspeed_loop(engine, 4)
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-5


# What a review found, read as a DeepSpeed user would: each failed before its fix.


def test_a_client_optimizer_gets_the_configs_settings(tmp_path):
    config = zero3_config(tmp_path, "cpu", "cpu")
    del config["optimizer"]
    engine, opt, _, _ = st.initialize(
        model=models.make("gpt"), config=config,
        optimizer=lambda params, **settings: st.OffloadLion(params, lr=1e-4, **settings))
    assert isinstance(opt, st.OffloadLion)
    assert opt.max_grad_norm == 6.0 and opt.gradient_accumulation_steps == MICRO
    with pytest.raises(TypeError, match="settings as keywords"):
        st.initialize(model=models.make("gpt"), config=config,
                      optimizer=lambda params: st.OffloadLion(params, lr=1e-4))
    with pytest.raises(TypeError, match="strata optimizer"):
        st.initialize(model=models.make("gpt"), config=config,
                      optimizer=lambda params, **_: torch.optim.AdamW(params))


def test_the_scheduler_does_not_step_on_steps_fp16_skipped(tmp_path):
    config = zero3_config(tmp_path, "cpu", "cpu")
    config["fp16"] = {"enabled": True, "initial_scale_power": 60}  # Every early step overflows.
    engine, opt, _, scheduler = st.initialize(
        model=models.make("gpt"), config=config,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: s + 1))
    for micro in range(MICRO):
        engine.backward(models.loss_of("gpt", engine, 0, micro, torch.float16))
        engine.step()
    assert opt.last_step["skipped"] and engine.skipped_steps == 1
    assert scheduler.last_epoch == 0


def test_a_config_with_comments_is_read_whole(tmp_path):
    params, states = tmp_path / "params", tmp_path / "states"
    params.mkdir()
    states.mkdir()
    config = zero3_config(tmp_path, "nvme", "nvme")
    config["zero_optimization"]["offload_param"]["nvme_path"] = str(params)
    config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(states)
    text = json.dumps(config, indent=1)
    path = tmp_path / "ds_config.json"
    path.write_text("// a comment\n" + text.replace('"stage": 3,', '"stage": 3, /* ZeRO-3 */'))
    engine, opt, _, _ = st.initialize(model=models.make("gpt"), config=str(path))
    assert opt._body.layout.plan.nvme_path == str(params)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    path.write_text("// a comment\n" + json.dumps(config))
    with pytest.raises(NotImplementedError, match="scheduler"):
        st.initialize(model=models.make("gpt"), config=str(path))


def test_keys_strata_does_not_use_are_named(tmp_path):
    config = zero3_config(tmp_path, "cpu", "cpu")
    config["activation_checkpointing"] = {"partition_activations": True}
    with pytest.warns(UserWarning, match="ignored.*activation_checkpointing"):
        st.initialize(model=models.make("gpt"), config=config)


def test_args_that_disagree_with_the_config_are_refused(tmp_path):
    config = zero3_config(tmp_path, "cpu", "cpu")
    args = types.SimpleNamespace(learning_rate=5e-5, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=MICRO, max_grad_norm=6.0,
                                 adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
                                 weight_decay=0.1, fp16=False, bf16=False)
    with pytest.raises(ValueError, match=r"optimizer.params.lr=0.003 but args say 5e-05"):
        st.initialize(args=args, model=models.make("gpt"), config=config)
    args.learning_rate = 3e-3
    args.deepspeed = config
    with pytest.raises(ValueError, match="both as config= and in args"):
        st.initialize(args=args, model=models.make("gpt"), config=config)
    engine, _, _, _ = st.initialize(args=args, model=models.make("gpt"))  # args.deepspeed
    assert engine.device == torch.device("cpu") and engine.local_rank == 0


def test_a_refused_initialize_leaves_the_model_as_it_was(tmp_path):
    config = zero3_config(tmp_path, "cpu", "cpu")
    config["fp16"] = {"enabled": True}
    model = models.make("gpt")
    with pytest.raises(ValueError, match="optimizer= was given"):
        st.initialize(model=model, config=config,
                      optimizer=lambda params, **s: st.OffloadAdamW(params, **s))
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).sum().isfinite()  # Not offloaded: readable.


def test_a_launcher_without_a_process_group_and_dist_init_required_false_is_refused(
        tmp_path, monkeypatch):
    """torchrun's variables for rank 0 of 2, no process group: initialize would create it;
    dist_init_required=False asks it not to, which leaves nothing to train with."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    model = models.make("gpt")
    with pytest.raises(ValueError, match=r"torchrun started 2 ranks.*dist_init_required=False"):
        st.initialize(model=model, config=zero3_config(tmp_path, "cpu", "cpu"),
                      dist_init_required=False)
    assert next(model.parameters()).sum().isfinite()  # Not offloaded: readable.


def test_several_ranks_on_gpus_are_refused_before_a_process_group_is_made(tmp_path, monkeypatch):
    """Across ranks on CUDA tensors is not built: refused on every rank alike, before the
    process group (or anything else) is made."""
    import torch.distributed as dist
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = models.make("gpt")
    with pytest.raises(NotImplementedError, match="across 2 ranks on GPUs"):
        st.initialize(model=model, config=zero3_config(tmp_path, "cpu", "cpu"))
    assert not dist.is_initialized()
    assert next(model.parameters()).device.type == "cpu"
