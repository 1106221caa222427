"""What happens when a rank fails: the collective timeout, the opt-out, and ``CollectiveTimeoutError``.

Every multi-rank communicator made by :func:`~torchsso2.distributed.get_communicator` gives up
on a collective that does not complete within a timeout (default :data:`DEFAULT_TIMEOUT_S`,
the environment variable :data:`TIMEOUT_ENV` or the ``timeout`` argument) and raises
:class:`CollectiveTimeoutError` naming this rank, the collective and the cause. When MPI is
selected, the library also installs the process-wide abort hooks (see
:mod:`~torchsso2.distributed.mpi_guard`) unless :data:`ABORT_ENV` is ``0`` or
``abort_on_exception=False`` is passed.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from typing import Optional

logger = logging.getLogger(__name__)

#: default seconds a rank waits in a collective (or in ``MPI_Init``) for the other ranks
DEFAULT_TIMEOUT_S = 60.0

#: environment variable overriding the default timeout, in seconds (e.g. ``TORCHSSO2_DIST_TIMEOUT=600``)
TIMEOUT_ENV = "TORCHSSO2_DIST_TIMEOUT"

#: environment variable; ``0`` / ``false`` / ``no`` / ``off`` stops the library from installing
#: its MPI abort hooks when it selects MPI
ABORT_ENV = "TORCHSSO2_ABORT_ON_EXCEPTION"

_FALSE = ("0", "false", "no", "off")


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: a peer rank exited, crashed or hung (the message says which)."""


def resolve_timeout(timeout: Optional[float] = None, env: Optional[dict] = None) -> float:
    """The collective timeout in seconds: ``timeout`` if given, else :data:`TIMEOUT_ENV`, else 60.

    Raises:
        ValueError: a timeout (argument or environment) that is not a finite number > 0.
    """
    if timeout is None:
        env = os.environ if env is None else env
        raw = env.get(TIMEOUT_ENV)
        if raw is None or raw.strip() == "":
            return DEFAULT_TIMEOUT_S
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0") from None
        if not 0 < timeout < math.inf:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a finite number of seconds > 0")
        return timeout
    # a NumPy scalar (np.int64(30), np.float32(30.0)) is a number of seconds too; bool is not
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < float(timeout) < math.inf:
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    return float(timeout)


def resolve_abort_on_exception(abort_on_exception: Optional[bool] = None, env: Optional[dict] = None) -> bool:
    """Whether to install the MPI abort hooks: the argument if given, else not ``ABORT_ENV=0``."""
    if abort_on_exception is not None:
        if not isinstance(abort_on_exception, bool):
            raise TypeError(f"abort_on_exception must be a bool or None, got {abort_on_exception!r}")
        return abort_on_exception
    env = os.environ if env is None else env
    return env.get(ABORT_ENV, "1").strip().lower() not in _FALSE


def launcher_rank(env: Optional[dict] = None) -> int:
    """This process's rank as announced by an MPI launcher or torchrun (-1 if none): usable before init."""
    env = os.environ if env is None else env
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "RANK"):
        value = env.get(key)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return -1


__all__ = [
    "ABORT_ENV",
    "CollectiveTimeoutError",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "launcher_rank",
    "resolve_abort_on_exception",
    "resolve_timeout",
]
