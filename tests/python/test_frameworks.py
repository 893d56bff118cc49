"""strata.torch inside the frameworks people train with, each run against the same run with
torch.optim.AdamW (same seed, same framework settings): losses within 1e-5 and parameters
within 1e-4. Small random-init models on CPU tensors.

Each framework with its defaults: gradient accumulation as it drives it (the optimizer's
default, gradient_accumulation_steps="auto", follows the framework's count, an epoch's short
last window included) and its own gradient clipping (the HF Trainer's max_grad_norm=1.0,
Lightning's gradient_clip_val by norm and by value, accelerate's clip_grad_norm_), which edits
the gradients after the updates started: the optimizer redoes what changed."""

import math
import pathlib
import subprocess
import sys
import tempfile

import accelerate
import pytest
import pytorch_lightning as pl
import torch
import transformers
from torch import nn

import strata.torch as st

HERE = pathlib.Path(__file__).parent


class Made:
    """Makes an OffloadAdamW and keeps it, to read its metrics after the framework is done."""

    def __init__(self, updates_ahead=None, **options) -> None:
        self.options = options
        self.optimizer = None
        # conftest's updates_ahead: every clip waits for an update to have started ahead.
        self.updates_ahead = updates_ahead

    def __call__(self, params):
        if hasattr(params, "parameters"):  # The HF Trainer's factory gets the model.
            params = params.parameters()
        self.optimizer = st.OffloadAdamW(params, **self.options)
        if self.updates_ahead is not None:
            self.updates_ahead.watch(self.optimizer)
        return self.optimizer

    def redone(self) -> int:
        """Chunk updates made during backward and redone because the gradients changed."""
        return self.optimizer.metrics()["rolled_back_updates"]

    def ahead(self) -> int:
        return self.optimizer.metrics()["speculative_updates"]


def close_runs(losses, reference_losses, model, reference):
    assert len(losses) == len(reference_losses) > 0
    worst = max(abs(a - b) for a, b in zip(losses, reference_losses))
    assert worst < 1e-5, (worst, losses, reference_losses)
    assert all(math.isfinite(a) for a in losses)
    # Absolute: the key part of an attention's input bias gets gradients of float noise only
    # (softmax ignores it), which Adam scales up to steps of lr either way.
    apart = max((a - b).abs().max().item()
                for a, b in zip(model.parameters(), reference.parameters()))
    assert apart < 1e-4, apart


# --------------------------------------------------------------------------- HF Trainer


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=2)
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.rows = torch.randint(0, 64, (count, 16), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def hf_train(make_optimizer, **arguments) -> tuple[list[float], nn.Module]:
    model = tiny_gpt2()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, learning_rate=1e-3, seed=0,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0, **arguments)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(18),
                                       optimizers=(make_optimizer(model), None))
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, model


# None: the optimizer's default (on CPU tensors the updates wait for step()); True: they run
# during backward and those the clip changed are redone.
@pytest.mark.parametrize("speculative", [None, True])
def test_hf_trainer_with_default_arguments_clips_at_one_exactly(speculative, updates_ahead):
    # max_grad_norm=1.0 by default: clip_grad_norm_ after every backward, clipping or not.
    arguments = dict(num_train_epochs=4)
    made = Made(updates_ahead if speculative else None, lr=1e-3,
                speculative_updates=speculative)
    losses, model = hf_train(made, **arguments)
    reference_losses, reference = hf_train(
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), **arguments)
    assert len(losses) == 36
    close_runs(losses, reference_losses, model, reference)
    if speculative:
        assert made.redone() > 0  # Some steps clipped after the updates had started.


def test_hf_trainer_accumulating_with_a_short_last_window():
    # 18 samples in batches of 2: nine micro-batches an epoch, windows of 4, 4 and 1; clipping at
    # the default 1.0 after each window.
    arguments = dict(gradient_accumulation_steps=4, num_train_epochs=10)
    losses, model = hf_train(lambda m: st.OffloadAdamW(m.parameters(), lr=1e-3), **arguments)
    reference_losses, reference = hf_train(
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), **arguments)
    assert len(losses) == 30
    close_runs(losses, reference_losses, model, reference)


def test_hf_trainer_resumes_from_its_checkpoint_in_a_new_process(tmp_path):
    # Twelve steps with checkpoints at 6 and 12; then, in another process, a new OffloadAdamW
    # resumed from the one at 6 by the Trainer (optimizer.pt through state_dict) finishes them.
    def run(*arguments):
        subprocess.run([sys.executable, str(HERE / "hf_resume.py"), *map(str, arguments)],
                       check=True, cwd=HERE, timeout=600)

    run("strata", tmp_path / "whole")
    run("torch", tmp_path / "torch")
    run("strata", tmp_path / "resumed", tmp_path / "whole" / "checkpoint-6")
    whole, reference, resumed = (torch.load(tmp_path / name / "final.pt")
                                 for name in ("whole", "torch", "resumed"))
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))
    assert max((a - b).abs().max().item() for a, b in zip(whole, reference)) < 1e-4


# ----------------------------------------------------------------------------- Lightning


class Regression(pl.LightningModule):
    def __init__(self, make_optimizer) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
        self.make_optimizer = make_optimizer
        self.losses: list[float] = []

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return self.make_optimizer(self.net.parameters())


def lightning_train(make_optimizer, **arguments) -> Regression:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(52, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    module = Regression(make_optimizer)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **arguments)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return module


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lightning_gradient_clipping(algorithm, updates_ahead):
    # Small enough to clip most steps: the clip changes every gradient after backward.
    arguments = dict(gradient_clip_val=0.05, gradient_clip_algorithm=algorithm, max_epochs=3)
    made = Made(updates_ahead, lr=1e-2, speculative_updates=True)
    module = lightning_train(made, **arguments)
    reference = lightning_train(lambda p: torch.optim.AdamW(p, lr=1e-2), **arguments)
    assert len(module.losses) == 39
    close_runs(module.losses, reference.losses, module.net, reference.net)
    assert made.redone() > 0


def test_lightning_accumulate_grad_batches_with_a_short_last_window():
    # 13 batches an epoch, accumulated by 3: windows of 3, 3, 3, 3 and 1.
    arguments = dict(accumulate_grad_batches=3, max_epochs=6)
    module = lightning_train(lambda p: st.OffloadAdamW(p, lr=1e-2), **arguments)
    reference = lightning_train(lambda p: torch.optim.AdamW(p, lr=1e-2), **arguments)
    assert len(module.losses) == 78
    close_runs(module.losses, reference.losses, module.net, reference.net)


# ---------------------------------------------------------------------------- accelerate


def accelerate_train(make_optimizer, max_norm: float = 0.0) -> tuple[list[float], nn.Module]:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 8, generator=g)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).cos()), batch_size=4)
    model, opt, data = accelerator.prepare(model, make_optimizer(model.parameters()), data)
    losses = []
    for _ in range(4):
        for xb, yb in data:  # Ten batches an epoch: windows of 3, 3, 3 and 1.
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                if max_norm > 0 and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_norm)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    accelerator.end_training()
    return losses, model


def test_accelerate_accumulate_with_a_short_last_window():
    losses, model = accelerate_train(lambda p: st.OffloadAdamW(p, lr=1e-2))
    reference_losses, reference = accelerate_train(lambda p: torch.optim.AdamW(p, lr=1e-2))
    assert len(losses) == 40
    close_runs(losses, reference_losses, model, reference)


@pytest.mark.parametrize("max_norm", [0.05, 1e9])  # Clipping most steps; never clipping.
def test_accelerate_accumulate_and_clip_grad_norm(max_norm, updates_ahead):
    made = Made(updates_ahead, lr=1e-2, speculative_updates=True)
    losses, model = accelerate_train(made, max_norm)
    reference_losses, reference = accelerate_train(lambda p: torch.optim.AdamW(p, lr=1e-2),
                                                   max_norm)
    close_runs(losses, reference_losses, model, reference)
    assert made.ahead() > 0  # Updates ran during backward...
    if max_norm > 1e6:
        assert made.redone() == 0  # ...and a clip that does not clip kept every one.
    else:
        assert made.redone() > 0
