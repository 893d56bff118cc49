"""PyTorch optimizers whose states live in host memory or on NVMe and whose update runs during
backward: change one line of a training loop.

    import strata.torch as st
    opt = st.OffloadAdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                          offload="nvme", nvme_path="/mnt/nvme0", max_grad_norm=1.0)

See docs/python.md for what each option does and how it maps to DeepSpeed's config.
"""

from strata.torch._deepspeed import ModelEngine, initialize
from strata.torch._launch import init_process_group
from strata.torch._offload_plan import offload_parameters
from strata.torch.optimizer import OffloadOptimizer
from strata.torch.rules import (
    OffloadAdagrad,
    OffloadAdam,
    OffloadAdamW,
    OffloadLion,
)

__all__ = ["OffloadAdamW", "OffloadAdam", "OffloadAdagrad", "OffloadLion", "OffloadOptimizer",
           "init_process_group", "offload_parameters", "initialize", "ModelEngine"]
