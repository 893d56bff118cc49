"""One rank of test_ranks.py's runs under torchrun (gloo, CPU tensors), on training.py's
transformer wrapped in FSDP2 (fully_shard) or DDP. Every step trains on one global batch that
the ranks split between them, so that a run's losses do not depend on the number of ranks.

  compare SCENARIO...   the same 20 steps with torch.optim.AdamW and with OffloadAdamW; rank 0
                        prints one JSON line per scenario: how far the runs are apart.
  checkpoint            10 steps then a torch.distributed.checkpoint (DCP) save (--save), or a
                        DCP load (--load); then steps 10 to 19. Rank 0 prints their losses.
  save-on-rank-0        shard_states' state_dict() as a trainer that saves on rank 0 only
                        calls it; rank 0 prints what happened.
  initialize SCENARIO...  strata.torch.initialize with a DeepSpeed config, started without a
                        process group: what it refuses, then DeepSpeed's loop against DDP +
                        torch AdamW per scenario (zero<stage>-<states>[-gas<n>]).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import strata.torch as st
import training

STEPS = 20
LR = 3e-3
KIND = "transformer"
GLOBAL_BATCH = 6  # Split evenly by 1, 2 or 3 ranks.
# compare --die: the rank that kills itself (SIGKILL, as the OOM killer would) after its first
# strata step.
DYING_RANK = -1
# initialize --raise: the rank whose forward raises in its third step.
RAISING_RANK = -1


def wrap(model: nn.Module, how: str) -> nn.Module:
    if how == "ddp":
        return DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def rank_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of (step, micro)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, training.VOCAB, (GLOBAL_BATCH, training.SEQ + 1), generator=g)
    rows = GLOBAL_BATCH // dist.get_world_size()
    mine = tokens[dist.get_rank() * rows:(dist.get_rank() + 1) * rows]
    return mine[:, :-1], mine[:, 1:]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


class Trainer:
    """A model, its optimizer and a cosine schedule over STEPS."""

    def __init__(self, how: str, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]):
        self.model = wrap(training.make_model(KIND), how)
        self.opt = make_optimizer(self.model)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=STEPS)
        self.clip_norms: list[float] = []  # What the user's clip_grad_norm_ returned.
        self.step_norms: list[float] = []  # What strata's steps reported.
        self.redone_steps = 0  # Steps whose updates made ahead were redone (changed gradients).

    def train(self, steps: range, *, gas: int = 1, user_clip: float | None = None) -> list[float]:
        """The steps' losses, averaged over ranks."""
        losses = []
        for step in steps:
            total = torch.zeros(())
            for micro in range(gas):
                x, y = rank_batch(step, micro)
                loss = training.loss_of(KIND, self.model, x, y) / gas
                loss.backward()
                total += loss.detach()
            if user_clip is not None:
                norm = nn.utils.clip_grad_norm_(
                    [p for p in self.model.parameters() if p.grad is not None], user_clip)
                self.clip_norms.append(float(full(norm)))
            self.opt.step()
            if isinstance(self.opt, st.OffloadOptimizer):
                self.step_norms.append(self.opt.last_step["grad_norm"])
                self.redone_steps += self.opt.last_step["changed_chunks"] > 0
                if dist.get_rank() == DYING_RANK:
                    os.kill(os.getpid(), signal.SIGKILL)
            self.opt.zero_grad()
            self.scheduler.step()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
        return losses

    def parameters(self) -> list[torch.Tensor]:
        return [full(p) for p in self.model.parameters()]


def torch_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(training.param_groups(model, LR), lr=LR)


def offload_adamw(**options) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: st.OffloadAdamW(training.param_groups(model, LR), lr=LR,
                                         chunk_size="16KiB", **options)


def compare(name: str, how: str, options: dict, *, gas: int = 1, strata_clips: bool = True) -> dict:
    """torch AdamW with the user's clip_grad_norm_, against OffloadAdamW clipping itself
    (max_grad_norm) or, with strata_clips False, under the same user's clip_grad_norm_. The
    clip is at the median norm of an unclipped run: about half the steps clip, so both of the
    step's paths run."""
    calibration = Trainer(how, torch_adamw)
    calibration.train(range(STEPS), gas=gas, user_clip=math.inf)
    max_norm = statistics.median(calibration.clip_norms)

    reference = Trainer(how, torch_adamw)
    reference_losses = reference.train(range(STEPS), gas=gas, user_clip=max_norm)
    strata = Trainer(how, offload_adamw(max_grad_norm=max_norm if strata_clips else 0.0,
                                        **options))
    losses = strata.train(range(STEPS), gas=gas, user_clip=None if strata_clips else max_norm)
    # The step reports the norm of the gradients it used: after the user's clip, if any.
    norms = reference.clip_norms
    # The states, as state_dict() gives them (gathered from every rank's part), against torch's.
    strata.opt.consolidate_state_dict(to=None)  # shard_states: every rank gathers them.
    states, reference_states = strata.opt.state_dict()["state"], reference.opt.state_dict()["state"]
    assert sorted(states) == sorted(reference_states)
    state_difference = max(
        (full(states[i][k]) - full(reference_states[i][k])).abs().max().item()
        / full(reference_states[i][k]).abs().max().clamp_min(1e-30).item()
        for i in states for k in ("exp_avg", "exp_avg_sq"))
    # The elements this rank's engine holds, against the model's.
    held = sum(strata.opt._table.engine_numel()) / sum(p.numel() for p in strata.opt._table.params)
    expected = norms if strata_clips else [min(n, max_norm) for n in norms]
    return {
        "scenario": name,
        "world": dist.get_world_size(),
        "loss_difference": max(abs(a - b) for a, b in zip(losses, reference_losses)),
        "parameter_difference": max((a - b).abs().max().item() for a, b in
                                    zip(strata.parameters(), reference.parameters())),
        "norm_difference": max(abs(a - b) / b for a, b in zip(strata.step_norms, expected)),
        "clipped_steps": sum(n > max_norm for n in norms),
        "state_difference": state_difference,
        "held_fraction": held,
        "redone_steps": strata.redone_steps,
    }


def checkpoint(args: argparse.Namespace) -> dict:
    make = torch_adamw if args.optimizer == "torch" else offload_adamw(
        offload=args.offload, nvme_path=args.nvme)
    trainer = Trainer("fsdp2", make)
    half = STEPS // 2
    if args.save:
        trainer.train(range(half))
    # DCP's recipe: the state_dicts (the template a load fills in, resharded to this world).
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.opt)
    state = {"model": model_state, "optimizer": optimizer_state,
             "scheduler": trainer.scheduler.state_dict()}
    if args.save:
        dcp.save(state, checkpoint_id=args.save)
    else:
        dcp.load(state, checkpoint_id=args.load)
        set_state_dict(trainer.model, trainer.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
    losses = trainer.train(range(half, STEPS))
    return {"world": dist.get_world_size(), "losses": losses,
            "parameters": [p.tolist() for p in trainer.parameters()]}


def save_on_rank_0() -> dict:
    """DDP + shard_states, 2 steps, then what a trainer saving on rank 0 only meets."""
    trainer = Trainer("ddp", offload_adamw(shard_states=True))
    trainer.train(range(2))
    opt, rank = trainer.opt, dist.get_rank()
    out = {}
    if rank == 0:
        # optimizer.state is this rank's slices: reading it on one rank takes no collective.
        first = next(iter(opt.state))
        out["local_state_elements"] = opt.state[first]["exp_avg"].numel()
        out["parameter_elements"] = first.numel()
        out["states_read_by_items"] = len(opt.state.items())
        try:
            opt.state_dict()
        except RuntimeError as e:
            out["unconsolidated"] = str(e)
    dist.barrier()  # A collective on rank 0 alone above would have hung or failed here.
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        saved = opt.state_dict()
        # Whole states in torch AdamW's format: they load into it.
        torch_adamw(training.make_model(KIND)).load_state_dict(saved)
        out["whole_state_elements"] = saved["state"][0]["exp_avg"].numel()
    else:
        try:
            opt.state_dict()
        except RuntimeError:
            out["other_rank_refused"] = True
    return out


def ds_config(stage: int, states: str | None, nvme: str, *, gas: int, clip: float,
              train_batch_size: int | None = None, **extra) -> dict:
    """A DeepSpeed config for this world (torchrun's WORLD_SIZE: the process group may not
    exist yet): every rank its share of GLOBAL_BATCH per micro-step."""
    micro = GLOBAL_BATCH // int(os.environ["WORLD_SIZE"])
    zero: dict = {"stage": stage}
    if states is not None:
        zero["offload_optimizer"] = {"device": states, "pin_memory": True,
                                     **({"nvme_path": nvme} if states == "nvme" else {})}
    return {"train_batch_size": train_batch_size or GLOBAL_BATCH * gas,
            "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "gradient_clipping": clip, "zero_optimization": zero, **extra}


def initialize_engine(config: dict | str, model: nn.Module | None = None, **kwargs):
    if model is None:
        model = training.make_model(KIND)
        # A buffer, as HF models have: DDP must not broadcast it before each forward (an
        # evaluation on rank 0 alone would hang).
        model.register_buffer("calls", torch.zeros(1))
    return model, st.initialize(
        model=model, config=config,
        optimizer=lambda params, **settings: st.OffloadAdamW(
            training.param_groups(model, LR), lr=LR, chunk_size="16KiB", **settings),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
        **kwargs)


def initialize_refusals(nvme: str) -> dict:
    """Called before any process group exists: initialize creates it (it refuses stage 3
    across ranks after that, before touching the model); then what it refuses."""
    out = {"group_before": dist.is_initialized()}
    model = training.make_model(KIND)
    before = [(p.data_ptr(), p.dtype, p.detach().clone()) for p in model.parameters()]
    try:  # bf16: a refusal after the model was cast would show.
        st.initialize(model=model, config=ds_config(3, "cpu", nvme, gas=1, clip=1.0,
                                                    bf16={"enabled": True}),
                      optimizer=lambda params, **settings: st.OffloadAdamW(params, **settings))
    except NotImplementedError as e:
        out["stage3"] = str(e)
    out["group_after"] = dist.is_initialized()
    out["model_unchanged"] = all(
        (p.data_ptr(), p.dtype) == (ptr, dtype) and torch.equal(value, p)
        for (ptr, dtype, value), p in zip(before, model.parameters()))
    try:
        initialize_engine(ds_config(1, "cpu", nvme, gas=1, clip=1.0, fp16={"enabled": True}))
    except NotImplementedError as e:
        out["fp16"] = str(e)
    # A trained parameter no step reaches (DeepSpeed's stages 0-2 allow it): two steps.
    model = training.make_model(KIND)
    model.unused = nn.Linear(2, 2)
    _, (engine, _, _, _) = initialize_engine(ds_config(1, "cpu", nvme, gas=1, clip=1.0), model)
    for step in range(2):
        x, y = rank_batch(step, 0)
        engine.backward(training.loss_of(KIND, engine, x, y))
        engine.step()
    out["unused_parameter_steps"] = engine.global_steps
    # A one-rank config's batch (micro x accumulation = train_batch_size) on several ranks.
    one_rank_batch = GLOBAL_BATCH // dist.get_world_size() * 2
    try:
        initialize_engine(ds_config(1, "cpu", nvme, gas=2, clip=1.0,
                                    train_batch_size=one_rank_batch))
    except ValueError as e:
        out["batch"] = str(e)
    # The last rank alone with another clip, another model, a config it cannot read: every rank
    # raises (none waits in a collective), naming the rank.
    last = dist.get_rank() == dist.get_world_size() - 1
    odd_model = training.make_model(KIND)
    if last:
        odd_model.head = nn.Linear(odd_model.head.in_features, training.VOCAB, bias=False)
    mismatches = {
        "config": lambda: initialize_engine(ds_config(1, "cpu", nvme, gas=1,
                                                      clip=2.0 if last else 1.0)),
        "model": lambda: st.initialize(
            model=odd_model, config=ds_config(1, "cpu", nvme, gas=1, clip=1.0),
            optimizer=lambda params, **settings: st.OffloadAdamW(params, **settings)),
        "unreadable": lambda: initialize_engine(
            f"{nvme}/missing.json" if last else ds_config(1, "cpu", nvme, gas=1, clip=1.0)),
        # Each node checks its own NVMe path (they may differ): the last rank's is missing.
        "nvme_path": lambda: initialize_engine(
            ds_config(1, "nvme", f"{nvme}/missing" if last else nvme, gas=1, clip=1.0)),
    }
    for name, attempt in mismatches.items():
        try:
            attempt()
        except Exception as e:  # The last rank's own error, whatever its kind.
            out[name] = str(e)
    return out


def initialize_scenario(name: str, nvme: str) -> dict:
    """DeepSpeed's loop on initialize's engine against DDP + torch AdamW with the user's clip,
    on the same global batches: `zero<stage>-<states>[-gas<n>]`."""
    parts = name.split("-")
    stage, states = int(parts[0][len("zero"):]), None if parts[1] == "device" else parts[1]
    gas = int(parts[2][len("gas"):]) if len(parts) > 2 else 1
    calibration = Trainer("ddp", torch_adamw)
    calibration.train(range(STEPS), gas=gas, user_clip=math.inf)
    max_norm = statistics.median(calibration.clip_norms)
    reference = Trainer("ddp", torch_adamw)
    reference_losses = reference.train(range(STEPS), gas=gas, user_clip=max_norm)

    model, (engine, opt, _, _) = initialize_engine(
        ds_config(stage, states, nvme, gas=gas, clip=max_norm))
    if RAISING_RANK == dist.get_rank():
        def fail(module, inputs):
            if engine.global_steps == 2:
                raise RuntimeError(f"rank {RAISING_RANK} raised in forward, as asked")
        model.register_forward_pre_hook(fail)
    losses, norms = [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(gas):
            x, y = rank_batch(step, micro)
            loss = training.loss_of(KIND, engine, x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        norms.append(engine.get_global_grad_norm())
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    held = sum(opt._table.engine_numel()) / sum(p.numel() for p in opt._table.params)
    # engine.module is the user's model, whole on every rank (its own buffer aside).
    mine = {k: v for k, v in engine.module.state_dict().items() if k != "calls"}
    theirs = reference.model.module.state_dict()
    whole = sorted(mine) == sorted(theirs) and all(
        (mine[k] - theirs[k]).abs().max().item() < 1e-4 for k in theirs)
    # An evaluation forward on rank 0 alone (DeepSpeed scripts do): no collective in it.
    if dist.get_rank() == 0:
        with torch.no_grad():
            engine(rank_batch(0, 0)[0])
    dist.barrier()
    return {
        "scenario": name,
        "world": engine.world_size,
        "ranks_agree": engine.global_rank == dist.get_rank()
        and engine.local_rank == int(os.environ["LOCAL_RANK"]),
        "global_steps": engine.global_steps,
        "loss_difference": max(abs(a - b) for a, b in zip(losses, reference_losses)),
        "parameter_difference": max((a - b).abs().max().item() for a, b in
                                    zip(model.parameters(), reference.parameters())),
        "norm_difference": max(abs(a - b) / b for a, b in zip(norms, reference.clip_norms)),
        "clipped_steps": sum(n > max_norm for n in reference.clip_norms),
        "held_fraction": held,
        "whole_state_dict": whole,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    compare_parser = commands.add_parser("compare")
    compare_parser.add_argument("--nvme", required=True, help="one directory for every rank")
    compare_parser.add_argument("--die", type=int, default=-1, help="this rank kills itself")
    compare_parser.add_argument("scenarios", nargs="+")
    commands.add_parser("save-on-rank-0")
    initialize_parser = commands.add_parser("initialize")
    initialize_parser.add_argument("--nvme", required=True, help="one directory for every rank")
    initialize_parser.add_argument("--raise", dest="raising", type=int, default=-1,
                                   help="this rank's forward raises in the third step")
    initialize_parser.add_argument("scenarios", nargs="+")
    checkpoint_parser = commands.add_parser("checkpoint")
    checkpoint_parser.add_argument("--optimizer", choices=["strata", "torch"], required=True)
    checkpoint_parser.add_argument("--offload", default="cpu")
    checkpoint_parser.add_argument("--nvme")
    where = checkpoint_parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--save")
    where.add_argument("--load")
    args = parser.parse_args()

    if args.command == "initialize":
        global RAISING_RANK
        RAISING_RANK = args.raising
        # No process group yet: initialize creates it, as DeepSpeed's does.
        results = [initialize_refusals(args.nvme)]
        results += [initialize_scenario(name, args.nvme) for name in args.scenarios]
    else:
        # torchrun's or mpirun's ranks alike (test_ranks.py runs both).
        st.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    if args.command == "compare":
        global DYING_RANK
        DYING_RANK = args.die
        scenarios = {
            "fsdp2-cpu-max_grad_norm": lambda: compare(
                "fsdp2-cpu-max_grad_norm", "fsdp2", {"offload": "cpu"}),
            "fsdp2-nvme-user-clip": lambda: compare(
                "fsdp2-nvme-user-clip", "fsdp2", {"offload": "nvme", "nvme_path": args.nvme},
                strata_clips=False),
            # Updates during backward, each shard's as its reduce-scattered gradient lands.
            "fsdp2-speculative": lambda: compare(
                "fsdp2-speculative", "fsdp2", {"offload": "cpu", "speculative_updates": True}),
            "fsdp2-accumulate": lambda: compare(
                "fsdp2-accumulate", "fsdp2", {"offload": "cpu"}, gas=2),
            "ddp-cpu": lambda: compare("ddp-cpu", "ddp", {"offload": "cpu"}),
            "ddp-shard_states-nvme": lambda: compare(
                "ddp-shard_states-nvme", "ddp",
                {"offload": "nvme", "nvme_path": args.nvme, "shard_states": True}),
            "ddp-shard_states-user-clip": lambda: compare(
                "ddp-shard_states-user-clip", "ddp", {"offload": "cpu", "shard_states": True},
                strata_clips=False),
        }
        results = [scenarios[name]() for name in args.scenarios]
    elif args.command == "save-on-rank-0":
        results = [save_on_rank_0()]
    elif args.command == "checkpoint":
        results = [checkpoint(args)]
    if dist.get_rank() == 0:
        for result in results:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # Skips gloo's teardown races at interpreter exit.


if __name__ == "__main__":
    main()
