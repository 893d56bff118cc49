"""Where the engine's messages go in Python: warnings through ``warnings`` (category
``StrataWarning``, so ``warnings.filterwarnings`` and pytest's ``-W`` reach them), everything else
through the ``strata`` logger (``logging.getLogger("strata")``), whose level and handlers are the
application's to set.

The engine logs from its own threads, which never take the GIL: its messages wait in a queue in
the binding and arrive here when an engine call returns (``_strata.deliver_logs``), and at exit.
"""

from __future__ import annotations

import atexit
import logging
import warnings

logger = logging.getLogger("strata")


class StrataWarning(UserWarning):
    """A warning from Strata's engine: a setting it changed, a file it left in place, ..."""


# strata::LogLevel's values.
_DEBUG, _INFO, _WARNING, _ERROR = 0, 1, 2, 3


def emit(level: int, message: str) -> None:
    """Called by the binding, with the GIL, for each message the engine logged."""
    if level == _WARNING:
        warnings.warn(message, StrataWarning, stacklevel=2)
    elif level >= _ERROR:
        logger.error(message)
    elif level == _INFO:
        logger.info(message)
    else:
        logger.debug(message)


def flush() -> None:
    """Delivers what the engine logged since its last call returned (an engine destroyed, say)."""
    from strata import _strata

    _strata.deliver_logs()


atexit.register(flush)
