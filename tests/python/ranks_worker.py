"""One rank of test_ranks.py's runs under torchrun (gloo, CPU tensors): the same 20 steps of
training.py's transformer with torch.optim.AdamW and with strata.torch.OffloadAdamW, wrapped in
FSDP2 (fully_shard) or DDP, every rank on its own batches. Rank 0 prints one JSON line per
scenario: how far the two runs' losses and parameters are apart."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import strata.torch as st
import training

STEPS = 20
LR = 3e-3
KIND = "transformer"
# --die: the rank that kills itself (SIGKILL, as the OOM killer would) in its first strata step.
DYING_RANK = -1


def wrap(model: nn.Module, how: str) -> nn.Module:
    if how == "ddp":
        return DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def run(how: str, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], *, gas: int,
        user_clip: float | None) -> tuple[list[float], list[torch.Tensor], list[float], list[float]]:
    """Losses (averaged over ranks), the full parameters at the end, the gradient norms the
    user's clip_grad_norm_ returned, and those strata's step reported."""
    model = wrap(training.make_model(KIND), how)
    opt = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, clip_norms, step_norms = [], [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(gas):
            x, y = training.batch(KIND, step * world + rank, micro)
            loss = training.loss_of(KIND, model, x, y) / gas
            loss.backward()
            total += loss.detach()
        if user_clip is not None:
            norm = nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                            user_clip)
            clip_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        if isinstance(opt, st.OffloadOptimizer):
            step_norms.append(opt.last_step["grad_norm"])
            if rank == DYING_RANK:
                os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        scheduler.step()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
              for p in model.parameters()]
    if isinstance(opt, st.OffloadOptimizer):
        opt.close()
    return losses, params, clip_norms, step_norms


def compare(name: str, how: str, strata_options: dict, *, gas: int = 1,
            strata_clips: bool = True) -> dict:
    """torch AdamW with the user's clip_grad_norm_, against OffloadAdamW clipping itself
    (max_grad_norm) or, with strata_clips False, under the same user's clip_grad_norm_."""
    def reference(model):
        return torch.optim.AdamW(training.param_groups(model, LR), lr=LR)

    def offload(model):
        return st.OffloadAdamW(training.param_groups(model, LR), lr=LR, chunk_size="16KiB",
                               max_grad_norm=max_norm if strata_clips else 0.0,
                               **strata_options)

    # The median norm of an unclipped run: about half the steps clip, so both of the step's
    # paths run.
    max_norm = statistics.median(run(how, reference, gas=gas, user_clip=math.inf)[2])
    ref_losses, ref_params, ref_norms, _ = run(how, reference, gas=gas, user_clip=max_norm)
    losses, params, _, norms = run(how, offload, gas=gas,
                                   user_clip=None if strata_clips else max_norm)
    # The step reports the norm of the gradients it used: after the user's clip, if any.
    expected = ref_norms if strata_clips else [min(n, max_norm) for n in ref_norms]
    return {
        "scenario": name,
        "world": dist.get_world_size(),
        "loss_difference": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "parameter_difference": max((a - b).abs().max().item()
                                    for a, b in zip(params, ref_params)),
        "norm_difference": max(abs(a - b) / b for a, b in zip(norms, expected)),
        "clipped_steps": sum(n > max_norm for n in ref_norms),
        "first_loss": ref_losses[0],
        "last_loss": ref_losses[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvme", required=True, help="one directory for every rank")
    parser.add_argument("--die", type=int, default=-1,
                        help="this rank kills itself in the middle of the first scenario")
    parser.add_argument("scenarios", nargs="+")
    args = parser.parse_args()
    global DYING_RANK
    DYING_RANK = args.die
    dist.init_process_group("gloo")
    scenarios = {
        "fsdp2-cpu-max_grad_norm": lambda: compare(
            "fsdp2-cpu-max_grad_norm", "fsdp2", {"offload": "cpu"}),
        "fsdp2-nvme-user-clip": lambda: compare(
            "fsdp2-nvme-user-clip", "fsdp2", {"offload": "nvme", "nvme_path": args.nvme},
            strata_clips=False),
        "fsdp2-accumulate": lambda: compare(
            "fsdp2-accumulate", "fsdp2", {"offload": "cpu"}, gas=2),
        "ddp-cpu": lambda: compare("ddp-cpu", "ddp", {"offload": "cpu"}),
    }
    for name in args.scenarios:
        result = scenarios[name]()
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # Skips gloo's teardown races at interpreter exit.


if __name__ == "__main__":
    main()
