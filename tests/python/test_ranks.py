"""strata.torch across ranks under torchrun (gloo, CPU tensors): OffloadAdamW on FSDP2's
sharded parameters and under DDP trains as torch.optim.AdamW does, with 2 and 3 ranks
(ranks_worker.py runs both and compares); a rank that dies takes the job down, named."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SCENARIOS = ["fsdp2-cpu-max_grad_norm", "fsdp2-nvme-user-clip", "fsdp2-accumulate", "ddp-cpu"]
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
    run = torchrun(ranks, "--nvme", str(tmp_path), *SCENARIOS)
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
    # Every rank updates its shards on NVMe, in the one directory they share, and leaves it clean.
    assert list(tmp_path.iterdir()) == []


def test_a_killed_rank_fails_the_job_naming_it(tmp_path):
    start = time.monotonic()
    run = torchrun(2, "--nvme", str(tmp_path), "--die", "1", "fsdp2-nvme-user-clip")
    assert run.returncode != 0
    # torchrun stops the surviving rank and names the one that died, and how.
    assert "rank      : 1" in run.stderr and "SIGKILL" in run.stderr, run.stderr
    assert time.monotonic() - start < TIMEOUT
