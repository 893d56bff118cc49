#!/usr/bin/env python3
"""A small GPT in plain PyTorch, trained on the shipped corpus with strata's OffloadAdamW.

The model is ordinary torch (embedding, causal self-attention blocks, a tied head); the only
Strata line is the optimizer, whose fp32 masters and Adam moments live on NVMe (a temporary
folder unless --nvme-path says otherwise) and are updated on the CPU while backward runs. On
CUDA when there is a GPU, on CPU tensors otherwise. With --offload-params the parameters
themselves live in host memory or on NVMe too, on the device only while their layer runs
(strata.torch.offload_parameters; --device-memory bounds them).

    PYTHONPATH=build/release/python python examples/python/train_gpt.py --steps 100
    PYTHONPATH=build/release/python python examples/python/train_gpt.py --offload-params nvme \
        --device-memory 4MiB
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import strata.torch as st

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus.txt"


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, w = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, w // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return h + self.mlp(self.norm2(h))


class GPT(nn.Module):
    def __init__(self, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)  # Bytes.
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.head.weight = self.embed.weight  # Tied input and output embeddings.
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        # Each parameter is used by the module that owns it: what lets offload_parameters (and
        # FSDP) bring it to the device just for that module.
        return self.head(self.norm(h))


def param_groups(model: nn.Module, lr: float, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, as GPT recipes do."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "position" not in n]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def unigram_entropy(data: torch.Tensor) -> float:
    counts = torch.bincount(data, minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--offload", choices=["cpu", "nvme"], default="nvme")
    parser.add_argument("--nvme-path", help="folder on an NVMe drive (default: a temporary one)")
    parser.add_argument("--chunk-size", default="1MiB", help="bytes of parameters per chunk")
    parser.add_argument("--offload-params", choices=["none", "cpu", "nvme"], default="none",
                        help="keep the parameters in host memory or on NVMe between uses")
    parser.add_argument("--device-memory", default=None,
                        help="with --offload-params: bytes of parameters and gradients the "
                        "device may hold (e.g. 4MiB; default: the engine's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    split = int(0.9 * len(data))
    train, validation = data[:split], data[split:]

    model = GPT(args.context, args.width, args.layers, args.heads).to(device, dtype)
    scratch = tempfile.TemporaryDirectory(prefix="strata-gpt-")
    nvme_path = args.nvme_path or scratch.name
    if args.offload_params != "none":
        st.offload_parameters(model, args.offload_params, nvme_path=nvme_path,
                              device_memory=args.device_memory)
    opt = st.OffloadAdamW(param_groups(model, args.lr, 0.1), lr=args.lr, betas=(0.9, 0.95),
                          offload=args.offload, nvme_path=nvme_path, max_grad_norm=1.0,
                          chunk_size=args.chunk_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps,
                                                   pct_start=0.1, cycle_momentum=False)
    params = sum(p.numel() for p in model.parameters())
    print(f"train_gpt: {params / 1e6:.2f}M parameters ({dtype}) on {device}; optimizer states "
          f"on {args.offload} ({nvme_path if args.offload == 'nvme' else 'host memory'}); "
          + (f"parameters on {args.offload_params} within {args.device_memory or 'the default'} "
             "of device memory; " if args.offload_params != "none" else "")
          + f"{args.steps} steps of {args.batch} x {args.context} bytes")

    def batch(source: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        starts = torch.randint(0, len(source) - args.context - 1, (args.batch,),
                               generator=generator)
        windows = torch.stack([source[s : s + args.context + 1] for s in starts]).to(device)
        return windows[:, :-1], windows[:, 1:]

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))

    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    # Each step's NVMe traffic is counted from the end of the one before, not from its own
    # start: the engine reads the next step's states ahead while the loop prints, and a read
    # that lands between two steps belongs to the next.
    moved = opt.metrics()
    for step in range(1, args.steps + 1):
        tick = time.perf_counter()
        x, y = batch(train, generator)
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        seconds = time.perf_counter() - tick
        now = opt.metrics()
        print(f"step {step:5d}  loss {loss.item():.4f}  {x.numel() / seconds:9.0f} tok/s  "
              f"{seconds:.3f} s  grad norm {opt.last_step['grad_norm']:.3f}  "
              f"nvme r {(now['nvme_read_bytes'] - moved['nvme_read_bytes']) / 2**20:.2f}MiB "
              f"w {(now['nvme_write_bytes'] - moved['nvme_write_bytes']) / 2**20:.2f}MiB",
              flush=True)
        moved = now

    with torch.no_grad():
        evaluation = torch.Generator().manual_seed(12345)
        validation_loss = sum(loss_of(*batch(validation, evaluation)).item()
                              for _ in range(16)) / 16
    entropy = unigram_entropy(train)
    verdict = "below" if validation_loss < entropy else "not below"
    m = opt.metrics()
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s; optimizer busy "
          f"{m['optimizer_seconds']:.2f} s")
    if args.offload_params != "none":
        fetched = m["fetched_from_host_bytes"] + m["fetched_from_nvme_bytes"]
        print(f"parameters: device peak {m['device_peak_bytes'] / 2**20:.2f} MiB of "
              f"{m['device_budget_bytes'] / 2**20:.2f} MiB; fetched "
              f"{fetched / args.steps / 2**20:.2f} MiB per step; waited "
              f"{m['fetch_stall_seconds']:.2f} s for fetches")
    print(f"validation loss {validation_loss:.4f} nats/byte: {verdict} the corpus' unigram "
          f"entropy {entropy:.4f} (the model uses its context)" if validation_loss < entropy
          else f"validation loss {validation_loss:.4f} nats/byte: {verdict} the corpus' unigram "
          f"entropy {entropy:.4f}")
    if not math.isfinite(validation_loss) or validation_loss >= entropy:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
