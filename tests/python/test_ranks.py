"""strata.torch across ranks under torchrun (gloo, CPU tensors): OffloadAdamW on FSDP2's
sharded parameters and under DDP trains as torch.optim.AdamW does, with 2 and 3 ranks
(ranks_worker.py runs both and compares); its torch.distributed.checkpoint checkpoints reshard
to other world sizes and load into torch AdamW and back; the same script runs as two torchrun
"nodes" meeting at a rendezvous and under mpirun (strata.torch.init_process_group); a rank that
dies takes the job down, named; strata.torch.initialize with DeepSpeed configs creates the
process group and trains ZeRO stages 0-2 as DDP with torch AdamW does."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import torch
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SCENARIOS = ["fsdp2-cpu-max_grad_norm", "fsdp2-nvme-user-clip", "fsdp2-speculative",
             "fsdp2-accumulate", "ddp-cpu", "ddp-shard_states-nvme", "ddp-shard_states-user-clip"]
# torchrun's own start and 3 ranks importing torch on a loaded 2-core machine, then 8 runs of 20
# steps each.
TIMEOUT = 900


def torchrun(ranks: int, *arguments: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={ranks}", str(HERE / "ranks_worker.py"), *arguments],
        cwd=HERE, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("ranks", [2, 3])
def test_offload_adamw_across_ranks_matches_torch_adamw(ranks, tmp_path):
    run = torchrun(ranks, "compare", "--nvme", str(tmp_path), *SCENARIOS)
    assert run.returncode == 0, run.stdout + run.stderr
    results = {r["scenario"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert sorted(results) == sorted(SCENARIOS)
    for name, r in results.items():
        assert r["world"] == ranks
        assert r["loss_difference"] < 1e-5, name
        assert r["parameter_difference"] < 1e-4, name
        # The step's norm is the global one (every rank's gradients), as torch's clip computes.
        assert r["norm_difference"] < 1e-5, name
        assert 0 < r["clipped_steps"] < 20, f"{name}: both clipped and unclipped steps"
        assert r["state_difference"] < 1e-4, name
        if name.startswith("fsdp2"):
            # What the engine took during backward is redone only on steps that clip: a clip
            # that does not multiplies by exactly 1. (Under DDP the hooks see each rank's own
            # gradients, before DDP averages them: every step's are redone.)
            assert r["redone_steps"] <= r["clipped_steps"], name
        # FSDP2 and shard_states: each rank's engine holds 1/N of the model (and a stand-in
        # element for each empty part); DDP without shard_states, all of it.
        if name == "ddp-cpu":
            assert r["held_fraction"] == 1.0
        else:
            assert r["held_fraction"] < 1 / ranks + 0.02, name
    # Every rank updates its shards on NVMe, in the one directory they share, and leaves it clean.
    assert list(tmp_path.iterdir()) == []


INITIALIZE = ["zero0-device", "zero1-cpu", "zero2-nvme-gas2"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_initialize_across_ranks_trains_as_ddp_with_torch_adamw(ranks, tmp_path):
    """DeepSpeed's initialize under torchrun with no process group: it creates one; stages 0,
    1 and 2 train as DDP + torch AdamW on the same global batches, stages 1 and 2 holding 1/N
    of the states on each rank; stage 3 and a one-rank batch are refused."""
    run = torchrun(ranks, "initialize", "--nvme", str(tmp_path), *INITIALIZE)
    assert run.returncode == 0, run.stdout + run.stderr
    refusals, *results = map(json.loads, run.stdout.splitlines())
    assert not refusals["group_before"] and refusals["group_after"]
    assert f"ZeRO stage 3 across {ranks} ranks" in refusals["stage3"]
    assert refusals["model_unchanged"]
    assert f"fp16 across {ranks} ranks" in refusals["fp16"]
    assert refusals["unused_parameter_steps"] == 2
    # micro x accumulation x world size.
    assert f"x {ranks});" in refusals["batch"], refusals["batch"]
    # Rank 0's view of a last rank that differs (the last rank raised too: none hung).
    last = ranks - 1
    assert refusals["config"].startswith(
        f"initialize: rank {last}'s config differs from rank 0's at optimizer.gradient_clipping: "
        "2.0 on"), refusals["config"]
    assert f"rank {last}'s model's parameters differ from rank 0's at head.bias" in \
        refusals["model"], refusals["model"]
    assert f"rank {last} could not read its config" in refusals["unreadable"], \
        refusals["unreadable"]
    assert f"rank {last} could not read its config: FileNotFoundError: nvme_path" in \
        refusals["nvme_path"], refusals["nvme_path"]
    assert [r["scenario"] for r in results] == INITIALIZE
    for r in results:
        name = r["scenario"]
        assert r["world"] == ranks and r["ranks_agree"], name
        assert r["global_steps"] == 20, name
        assert r["loss_difference"] < 1e-5, name
        assert r["parameter_difference"] < 1e-4, name
        assert r["norm_difference"] < 1e-5, name
        assert 0 < r["clipped_steps"] < 20, name
        assert r["whole_state_dict"], name
        if name.startswith("zero0"):
            assert r["held_fraction"] == 1.0
        else:
            assert r["held_fraction"] < 1 / ranks + 0.02, name
    assert list(tmp_path.iterdir()) == []


def test_a_rank_raising_in_forward_under_initialize_fails_the_job_naming_it(tmp_path):
    start = time.monotonic()
    run = torchrun(2, "initialize", "--nvme", str(tmp_path), "--raise", "1", "zero1-cpu")
    assert run.returncode != 0
    # The raising rank's error, and torchrun's summary naming it (the other rank, waiting in
    # the step's collectives, is stopped).
    assert "RuntimeError: rank 1 raised in forward, as asked" in run.stderr, run.stderr
    assert "rank      : 1" in run.stderr, run.stderr
    assert time.monotonic() - start < TIMEOUT


def test_a_killed_rank_fails_the_job_naming_it(tmp_path):
    start = time.monotonic()
    run = torchrun(2, "compare", "--nvme", str(tmp_path), "--die", "1", "fsdp2-nvme-user-clip")
    assert run.returncode != 0
    # torchrun stops the surviving rank and names the one that died, and how.
    assert "rank      : 1" in run.stderr and "SIGKILL" in run.stderr, run.stderr
    assert time.monotonic() - start < TIMEOUT


def checkpoint_run(ranks: int, optimizer: str, *arguments: str) -> dict:
    """Steps 10 to 19 of a run that saved a DCP checkpoint at step 10 (--save) or loaded one."""
    run = torchrun(ranks, "checkpoint", "--optimizer", optimizer, *arguments)
    assert run.returncode == 0, run.stdout + run.stderr
    [result] = map(json.loads, run.stdout.splitlines())
    assert result["world"] == ranks
    return result


def assert_continues(run: dict, uninterrupted: dict) -> None:
    assert run["losses"] == pytest.approx(uninterrupted["losses"], abs=1e-5)
    for a, b in zip(run["parameters"], uninterrupted["parameters"]):
        assert torch.tensor(a).sub(torch.tensor(b)).abs().max() < 1e-4


def test_a_dcp_checkpoint_reshards_and_loads_into_torch_adamw_and_back(tmp_path):
    # Saved by 2 ranks with the states on NVMe, which then go on to step 20 uninterrupted.
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    strata_dir, torch_dir = str(tmp_path / "strata"), str(tmp_path / "torch")
    strata = checkpoint_run(2, "strata", "--offload", "nvme", "--nvme", str(nvme),
                            "--save", strata_dir)
    torch_adamw = checkpoint_run(2, "torch", "--save", torch_dir)
    assert_continues(strata, torch_adamw)
    # Loaded by 1 and by 3 ranks (host memory), the run goes on as if never stopped.
    for ranks in (1, 3):
        assert_continues(checkpoint_run(ranks, "strata", "--load", strata_dir), strata)
    # torch AdamW's checkpoint into OffloadAdamW, and OffloadAdamW's into torch AdamW.
    assert_continues(checkpoint_run(2, "strata", "--load", torch_dir), torch_adamw)
    assert_continues(checkpoint_run(3, "torch", "--load", strata_dir), strata)


def test_shard_states_without_a_process_group_says_what_to_do():
    import strata.torch as st

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="init_process_group"):
        st.OffloadAdamW(model.parameters(), shard_states=True)


def test_two_nodes_meet_at_a_torchrun_rendezvous(tmp_path):
    # Two torchrun agents, one rank each, as on two nodes: the c10d rendezvous on a free port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=strata",
               str(HERE / "ranks_worker.py"), "compare", "--nvme", str(tmp_path),
               "fsdp2-cpu-max_grad_norm"]
    nodes = [subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=TIMEOUT) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    [result] = [json.loads(line) for out, _ in outputs for line in out.splitlines()]
    assert result["world"] == 2 and result["parameter_difference"] < 1e-4


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun")
def test_mpirun_ranks_find_each_other(tmp_path):
    # strata.torch.init_process_group reads Open MPI's variables and meets on this node.
    run = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable,
         str(HERE / "ranks_worker.py"), "compare", "--nvme", str(tmp_path),
         "ddp-shard_states-user-clip"],
        cwd=HERE, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stdout + run.stderr
    [result] = map(json.loads, run.stdout.splitlines())
    assert result["world"] == 2 and result["parameter_difference"] < 1e-4


def lone_environment() -> dict:
    """This environment without any launcher's variables: a process started by hand."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}


def test_a_lone_process_gets_a_group_of_one(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", "import strata.torch as st, torch.distributed as dist; "
         "place = st.init_process_group(); print(place['launcher'], dist.get_world_size())"],
        capture_output=True, text=True, timeout=TIMEOUT, env=lone_environment())
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["none", "1"]


def test_shard_states_saved_on_rank_0_only_says_to_consolidate():
    # The HF Trainer under DDP calls state_dict() on rank 0 alone: no hang, a clear error, and
    # consolidate_state_dict() on every rank first gives rank 0 whole states for torch AdamW.
    run = torchrun(2, "save-on-rank-0")
    assert run.returncode == 0, run.stdout + run.stderr
    [result] = map(json.loads, run.stdout.splitlines())
    assert result["local_state_elements"] == result["parameter_elements"] // 2
    assert result["states_read_by_items"] > 0
    assert "consolidate_state_dict" in result["unconsolidated"]
    assert result["whole_state_elements"] == result["parameter_elements"]


LONE_RANK = """
import torch, strata.torch as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
st.init_process_group()
outcomes = []
def attempt(build):
    try:
        build()
        outcomes.append("built")
    except NotImplementedError as e:
        outcomes.append("fp16" if "fp16" in str(e) else str(e))
half = torch.nn.Linear(8, 8).half()
attempt(lambda: st.OffloadAdamW(half.parameters(), shard_states=True))
sharded = fully_shard(torch.nn.Linear(8, 8).half(), mesh=init_device_mesh("cpu", (1,)))
attempt(lambda: st.OffloadAdamW(sharded.parameters()))
# Every parameter frozen but one that never gets a gradient: state_dict still works.
frozen = torch.nn.Linear(8, 8)
frozen.weight.requires_grad_(False)
opt = st.OffloadAdamW(frozen.parameters(), shard_states=True)
opt.consolidate_state_dict()
outcomes.append(len(opt.state_dict()["state"]))
print(outcomes)
"""


def test_fp16_across_ranks_is_refused_and_a_frozen_model_consolidates():
    run = subprocess.run([sys.executable, "-c", LONE_RANK], capture_output=True, text=True,
                         timeout=TIMEOUT, env=lone_environment())
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "['fp16', 'fp16', 1]"
