"""Strata: an offload engine for training models whose state does not fit in GPU memory.

``strata.torch`` holds the PyTorch optimizers (``OffloadAdamW`` and friends); ``strata.Engine``
is the engine's thin binding underneath them, one call for one C++ call (see
docs/python.md). The engine's messages go to the ``strata`` logger and its warnings through
``warnings`` as ``StrataWarning`` (strata/_log.py).
"""

from strata._log import StrataWarning
from strata._strata import Engine, bench_adam, built_with_cuda, parse_bytes

__all__ = ["Engine", "StrataWarning", "bench_adam", "built_with_cuda", "parse_bytes"]
__version__ = "0.1.0"
