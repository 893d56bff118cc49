"""Models and a loop for the parameter-offload tests (test_param_offload.py, and the process
that resumes from a checkpoint, param_offload_resume.py): a small GPT whose head is tied to its
embedding and whose layers may run under activation checkpointing, and an MLP that calls one
layer twice and keeps one frozen."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

import training
from training import SEQ, VOCAB, Block

batch = training.batch  # The tests' micro-batches, as the loop below trains on them.


class TiedGPT(nn.Module):
    """Embedding, learned positions (a parameter of the root module itself), transformer
    layers, and a head that shares the embedding's weight (GPT-2's weight tying)."""

    def __init__(self, width: int = 32, layers: int = 6, checkpointing: str | None = None):
        super().__init__()
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(SEQ, width) * 0.02)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position
        for layer in self.layers:
            if self.checkpointing is None:
                h = layer(h)
            else:
                h = torch.utils.checkpoint.checkpoint(
                    layer, h, use_reentrant=self.checkpointing == "reentrant")
        return self.head(self.norm(h))


class SharedMLP(nn.Module):
    """A frozen input projection, then hidden layers with one layer applied before and after
    the others (shared weights)."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(24, 64)
        self.inp.requires_grad_(False)
        self.shared = nn.Linear(64, 64)
        self.hidden = nn.ModuleList(nn.Linear(64, 64) for _ in range(hidden))
        self.norm = nn.LayerNorm(64)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = self.norm(h + torch.tanh(self.shared(h)))
        for layer in self.hidden:
            h = h + torch.tanh(layer(h))
        h = h + torch.tanh(self.shared(h))
        return self.out(h)


def make(kind: str, checkpointing: str | None = None, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = SharedMLP() if kind == "mlp" else TiedGPT(checkpointing=checkpointing)
    return model.to(dtype)


def loss_of(kind: str, model: nn.Module, step: int, micro: int,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """training.py's loss of micro-batch `micro` of step `step`, the input cast to `dtype`
    (an offloaded model's parameters cannot be asked: they are not on the device)."""
    return training.loss_of(kind, model, *training.batch(kind, step, micro), dtype)


def train(kind: str, model: nn.Module, opt: torch.optim.Optimizer, steps: range, *,
          gas: int = 1, clip: float = 0.0, dtype: torch.dtype = torch.float32) -> list[float]:
    """training.py's plain loop; `clip` > 0 clips with torch.nn.utils (for torch's optimizer:
    strata's clips inside, given max_grad_norm)."""
    return training.loop(model, opt, steps, lambda s, m: loss_of(kind, model, s, m, dtype),
                         gas=gas, clip=clip)
