"""initialize across ranks: the process group DeepSpeed's initialize would create, what
every rank must agree on, and the model wrapped as the config's ZeRO stage shares it. CPU
tensors (gloo) so far: across ranks on GPUs is refused before a process group is made.

DeepSpeed's stages map onto what strata.torch already runs across ranks:

* stage 0 -> DDP (every rank holds everything; gradients averaged across ranks);
* stages 1 and 2 -> DDP with the optimizer's ``shard_states``: each rank keeps and updates 1/N
  of every parameter's optimizer states (where offload_optimizer says), and the updated slices
  are all-gathered, so the parameters stay whole on every rank, as ZeRO-1/2's do (the
  gradients stay whole too: DDP all-reduces them, so stage 2 holds what stage 1 holds);
* stage 3 (parameters partitioned, offloaded or not) is refused across ranks: it is not built.

Every rank reads the config, then the ranks compare what they read and their models' parameters
(read_config_alike), so that a rank that differs is an error naming it on every rank, not a
hang. ``engine.module`` stays the user's model (its ``state_dict()`` whole on every rank); the DDP
wrapper only runs its forward.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from strata.torch import _native
from strata.torch._launch import init_process_group


@dataclasses.dataclass(frozen=True)
class Place:
    """Where this process is: DeepSpeed's engine.global_rank, local_rank and world_size."""
    global_rank: int
    local_rank: int
    world_size: int


def join(dist_init_required: bool | None) -> Place:
    """This process's place, creating torch.distributed's default process group when a launcher
    started several ranks and none exists yet (DeepSpeed's initialize calls init_distributed:
    without it, each rank would train alone on its own data). ``dist_init_required`` is
    DeepSpeed's: None creates the group where needed, False refuses to."""
    launched = _native.detect_ranks()
    if dist.is_available() and dist.is_initialized():
        place = Place(dist.get_rank(), launched["local_rank"], dist.get_world_size())
        _refuse_gpus(place.world_size)
        return place
    if launched["size"] == 1:
        return Place(0, 0, 1)
    _refuse_gpus(launched["size"])
    if dist_init_required is False:
        raise ValueError(
            f"{launched['launcher']} started {launched['size']} ranks, no torch.distributed "
            "process group exists and initialize(dist_init_required=False) was given: call "
            "strata.torch.init_process_group() (or torch.distributed.init_process_group) "
            "first, or leave dist_init_required unset for initialize to create it")
    init_process_group("gloo")  # CPU tensors: GPUs across ranks are refused above.
    return Place(dist.get_rank(), launched["local_rank"], dist.get_world_size())


def _refuse_gpus(world_size: int) -> None:
    """initialize puts the model on the GPU where there is one; across ranks that is not built
    (refused before a process group is made, on every rank alike)."""
    if world_size > 1 and torch.cuda.is_available():
        raise NotImplementedError(
            f"strata.torch.initialize across {world_size} ranks on GPUs (CUDA tensors over "
            "NCCL) is not built yet: across ranks it runs on CPU tensors (gloo) so far")


def read_config_alike(place: Place, read: Callable[[], tuple[dict, dict]],
                      model: torch.nn.Module) -> tuple[dict, dict]:
    """`read()` (the config as the engine parses it) on every rank, then, before anything is
    changed: every rank read it without error, the same config and a model with the same
    parameters, else an error on every rank naming the rank and the first difference from rank
    0's. A rank that failed or differed alone would leave the others waiting in the first
    collective until the process group's timeout. The NVMe paths may differ: each node its own
    drives."""
    if place.world_size == 1:
        return read()
    try:
        loaded, document = read()
        options = json.loads(loaded["options"])
        config = {**options, "nvme": {k: v for k, v in options["nvme"].items() if k != "paths"}}
        mine = {"error": None, "config": _flatten(config)}
    except Exception as e:  # Reported below, once every rank knows.
        failure, mine = e, {"error": f"{type(e).__name__}: {e}"}
    else:
        failure = None
    mine["model"] = {name: f"{tuple(p.shape)} {p.dtype}" for name, p in model.named_parameters()}
    everyone: list = [None] * place.world_size
    dist.all_gather_object(everyone, mine)
    if failure is not None:
        raise failure
    for rank, theirs in enumerate(everyone):
        if theirs["error"] is not None:
            raise ValueError(f"initialize: rank {rank} could not read its config: "
                             f"{theirs['error']}")
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for what, noun in (("config", "config differs"), ("model", "model's parameters differ")):
            difference = _first_difference(first[what], theirs[what])
            if difference is not None:
                key, at_zero, at_rank = difference
                raise ValueError(
                    f"initialize: rank {rank}'s {noun} from rank 0's at {key}: {at_rank} on "
                    f"rank {rank}, {at_zero} on rank 0; every rank must start with the same "
                    "config and model")
    return loaded, document


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = repr(value)
    return out


def _first_difference(a: dict, b: dict) -> tuple[str, str, str] | None:
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) != b.get(key):
            return key, a.get(key, "nothing"), b.get(key, "nothing")
    return None


def device_of(model: torch.nn.Module) -> torch.device:
    """The process's current GPU where there is one (one rank: GPUs across ranks are refused
    in join), else the model's device (CPU)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return next(model.parameters()).device


def refuse_unbuilt(place: Place, stage: int, working_dtype: str) -> None:
    """Before anything is changed: what initialize cannot run across these ranks."""
    if place.world_size > 1 and working_dtype == "fp16":
        raise NotImplementedError(
            f"fp16 across {place.world_size} ranks is not built yet in strata.torch.initialize: "
            "each rank's engine would check overflow on its part of the states alone, and a "
            "step skipped on one rank must be skipped on all; use bf16 (or fp32)")
    if place.world_size > 1 and stage == 3:
        raise NotImplementedError(
            f"ZeRO stage 3 across {place.world_size} ranks (parameters partitioned between "
            "ranks, offloaded or not) is not built yet in strata.torch.initialize: use stage 1 "
            "or 2 with offload_optimizer (optimizer states sharded and offloaded), or FSDP2's "
            "fully_shard with strata.torch.OffloadAdamW (docs/python.md, \"Several GPUs\")")


def wrap(model: torch.nn.Module, place: Place) -> torch.nn.Module:
    """What runs the model's forward: DDP across ranks (DDP broadcasts rank 0's parameters and
    buffers, and refuses models whose parameters differ in shape across ranks), the model
    itself on one."""
    if place.world_size == 1:
        return model
    device = next(model.parameters()).device
    # As DeepSpeed's stages 0-2 do: parameters that get no gradient in a step are allowed
    # (find_unused_parameters), and buffers are each rank's own after the start (no broadcast
    # from rank 0 before each forward, which would hang an evaluation run on rank 0 alone).
    return DistributedDataParallel(model,
                                   device_ids=[device.index] if device.type == "cuda" else None,
                                   broadcast_buffers=False, find_unused_parameters=True)


def shards_states(place: Place, stage: int) -> bool:
    """ZeRO-1 and ZeRO-2 partition the optimizer states across ranks: shard_states does."""
    return place.world_size > 1 and stage in (1, 2)
