"""Small torch models and one training loop, shared by the equivalence tests and by the
process that resumes from a state_dict (resume.py): the same steps with torch.optim.AdamW and
with strata.torch.OffloadAdamW."""

from __future__ import annotations

import torch
from torch import nn

import strata.torch as st

VOCAB = 32
SEQ = 12


class Block(nn.Module):
    """A pre-norm transformer layer. The key projection has no bias: its gradient is zero up to
    rounding (softmax ignores a shift shared by every key), and Adam turns that rounding noise
    into full-size updates, so no two implementations of Adam agree on such a bias."""

    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width, bias=False)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, w = h.shape
        x = self.norm1(h)
        q, k, v = (f(x).view(b, t, self.heads, w // self.heads).transpose(1, 2)
                   for f in (self.query, self.key, self.value))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(a.transpose(1, 2).reshape(b, t, w))
        return h + self.mlp(self.norm2(h))


class TinyTransformer(nn.Module):
    """Two transformer layers over an embedding: a character model in miniature."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(SEQ, width) * 0.02)
        self.layers = nn.ModuleList(Block(width) for _ in range(2))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(24, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64),
                              nn.GELU(), nn.Linear(64, 8))
        model[0].requires_grad_(False)  # A frozen input layer.
    else:
        model = TinyTransformer()
        model.embed.requires_grad_(False)  # A frozen embedding, as in fine-tuning.
    return model


def batch(kind: str, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    if kind == "mlp":
        x = torch.randn(16, 24, generator=g)
        return x, torch.randn(16, 8, generator=g)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """The model's loss on (x, y), in fp32; a floating input is cast to `dtype` (default: the
    model's)."""
    if x.is_floating_point():
        x = x.to(dtype or next(model.parameters()).dtype)
    out = model(x).float()
    if kind == "mlp":
        return ((out - y) ** 2).mean()
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def param_groups(model: nn.Module, lr: float) -> list[dict]:
    """Decay on matrices; none, and twice the lr, on biases, norms and positions."""
    decay = [p for p in model.parameters() if p.ndim >= 2 and not _is_norm(model, p)]
    others = [p for p in model.parameters() if all(p is not q for q in decay)]
    return [{"params": decay, "weight_decay": 0.1, "lr": lr},
            {"params": others, "weight_decay": 0.0, "lr": 2 * lr}]


def _is_norm(model: nn.Module, p: torch.Tensor) -> bool:
    return any(p is q for m in model.modules() if isinstance(m, nn.LayerNorm)
               for q in m.parameters())


def make_optimizer(which: str, model: nn.Module, *, lr: float, max_grad_norm: float,
                   gas: int, nvme_path: str | None = None) -> torch.optim.Optimizer:
    groups = param_groups(model, lr)
    if which == "torch":
        # The single-tensor loop on every device (CUDA would default to foreach): the same
        # arithmetic as the CPU reference, which the tolerances were measured against.
        return torch.optim.AdamW(groups, lr=lr, foreach=False)
    return st.OffloadAdamW(groups, lr=lr, offload=which, nvme_path=nvme_path,
                           max_grad_norm=max_grad_norm, gradient_accumulation_steps=gas,
                           chunk_size="16KiB")


def train(kind: str, model: nn.Module, opt: torch.optim.Optimizer, scheduler, steps: range, *,
          gas: int, max_grad_norm: float, device: str | torch.device = "cpu") -> list[float]:
    """Steps `steps`, each over `gas` micro-batches moved to `device`, clipping on the global
    norm: by torch for torch.optim, by the optimizer itself for strata. Returns the losses."""
    def loss(step: int, micro: int) -> torch.Tensor:
        return loss_of(kind, model, *(t.to(device) for t in batch(kind, step, micro)))

    reference = not isinstance(opt, st.OffloadOptimizer)
    return loop(model, opt, steps, loss, gas=gas, clip=max_grad_norm if reference else 0.0,
                scheduler=scheduler)


def loop(model: nn.Module, opt: torch.optim.Optimizer, steps: range, loss, *, gas: int = 1,
         clip: float = 0.0, scheduler=None) -> list[float]:
    """The plain loop: each step over `gas` micro-batches (loss(step, micro) / gas, as DeepSpeed
    and torchao have the trainer do), clipped to `clip` by torch.nn.utils when > 0, then step(),
    zero_grad() and the scheduler's step. Returns each step's loss."""
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(gas):
            value = loss(step, micro) / gas
            value.backward()
            total += value.item()
        if clip > 0:
            nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    return losses


def relative_difference(a: nn.Module | list, b: nn.Module | list) -> float:
    """max over parameters of ||a - b||_inf / ||b||_inf."""
    pa = list(a.parameters()) if isinstance(a, nn.Module) else a
    pb = list(b.parameters()) if isinstance(b, nn.Module) else b
    return max(((x.detach().float() - y.detach().float()).abs().max()
                / y.detach().float().abs().max().clamp_min(1e-30)).item()
               for x, y in zip(pa, pb))
