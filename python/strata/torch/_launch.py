"""init_process_group: torch.distributed's process group for whichever launcher started this
process, so that one script runs under torchrun, mpirun and srun alike.

torchrun says who a process is in torch's own variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); mpirun and srun say it in theirs and name no rendezvous. The engine's DetectRanks
(offload/ranks.h) reads every launcher's variables; the rendezvous is MASTER_ADDR and
MASTER_PORT where set, else, when every rank is on this node, this node at a port derived from
the launcher's job id (the same on every rank of the job, different for the next job). Ranks on
several nodes without MASTER_ADDR are refused with what to set.
"""

from __future__ import annotations

import datetime
import os
import zlib

import torch.distributed as dist

from strata.torch import _native

# Ports derived from a job id fall in [_PORT_BASE, _PORT_BASE + _PORT_SPAN): above torchrun's
# default 29500 and below Linux's ephemeral range (32768 on).
_PORT_BASE, _PORT_SPAN = 29600, 3000
# Variables that name the job (the same on all its ranks), most specific first.
_JOB_IDS = ["TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "SLURM_JOB_ID"]


def init_process_group(backend: str = "gloo", *,
                       timeout: datetime.timedelta | None = None) -> dict:
    """Initialises torch.distributed's default process group from the launcher's environment
    (nothing to do if it already is) and returns this process's place: rank, size, local_rank,
    local_size and launcher ("torchrun", "mpirun", "srun", "pmix", "none"). `backend`: "gloo"
    for CPU tensors, "nccl" for GPUs. `timeout`: how long a collective waits for a rank that
    does not come (torch's default otherwise): a dead rank fails the others then."""
    place = _native.detect_ranks()
    if dist.is_initialized():
        return place
    kwargs = {} if timeout is None else {"timeout": timeout}
    if place["launcher"] == "none":
        # A lone process: a group of one, without a port to bind.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                **kwargs)
        return place
    address = os.environ.get("MASTER_ADDR")
    if address is None:
        if place["local_size"] != place["size"]:
            raise ValueError(
                f"{place['launcher']} started {place['size']} ranks on several nodes and "
                "MASTER_ADDR is not set: set it (and MASTER_PORT) to the address of rank 0's "
                "node, e.g. under Slurm MASTER_ADDR=$(scontrol show hostnames "
                "$SLURM_JOB_NODELIST | head -n1)")
        address = "127.0.0.1"
    port = os.environ.get("MASTER_PORT") or str(_job_port())
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=place["rank"],
                            world_size=place["size"], **kwargs)
    return place


def _job_port() -> int:
    job = next((os.environ[v] for v in _JOB_IDS if os.environ.get(v)), None)
    if job is None:
        raise ValueError(
            "neither MASTER_PORT nor a job id (" + ", ".join(_JOB_IDS) + ") is set: set "
            "MASTER_PORT to a free port, the same on every rank")
    return _PORT_BASE + zlib.crc32(job.encode()) % _PORT_SPAN
