"""Communicator over ``mpi4py``: numpy buffers, ``Allreduce`` and ``Bcast``.

Each bucket is moved to a contiguous CPU numpy array (float16 and bfloat16 travel as
float32, which MPI reduces portably), reduced or broadcast in place, and copied back to
the tensors' device and dtype.

Failure behaviour: MPI has no timeouts. A process that *dies* is noticed by the launcher
(``mpiexec`` of MPICH/hydra and Open MPI kill the remaining ranks), but a rank that
*raises* would run Python's exit handlers, ``MPI_Finalize`` among them, while its peers
wait in a collective forever. Call :func:`install_abort_on_exception` once at start-up
(or run the script with ``python -m mpi4py script.py``): an uncaught exception then prints
its traceback and calls ``MPI_Abort``, which takes the whole job down with a non-zero exit.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Optional

import torch
from torch import Tensor

from torchsso2.distributed.communicator import BucketedCommunicator

logger = logging.getLogger(__name__)

MPI_SIZE_ENV_VARS: tuple[str, ...] = (
    "OMPI_COMM_WORLD_SIZE",  # Open MPI
    "PMI_SIZE",  # MPICH / hydra, Intel MPI, srun --mpi=pmi2
    "MPI_LOCALNRANKS",  # MPICH
    "PMIX_SIZE",  # PMIx launchers
    "MV2_COMM_WORLD_SIZE",  # MVAPICH2
)
"""Environment variables through which MPI launchers announce the world size."""

INSTALL_HINT = "`pip install mpi4py mpich` (or, from a checkout, `pip install -e \".[mpi]\"`)"

_ExceptHook = Callable[[type[BaseException], BaseException, Optional[TracebackType]], Any]  # runtime alias: 3.9-safe


def mpi_launch_size(env: dict[str, str] | None = None) -> int:
    """World size announced by an MPI launcher's environment, or 0 if none is found.

    Reads only environment variables (see :data:`MPI_SIZE_ENV_VARS`), so it is safe to call
    before importing ``mpi4py`` (importing it initializes MPI).
    """
    env = dict(os.environ) if env is None else env
    for key in MPI_SIZE_ENV_VARS:
        value = env.get(key)
        if value:
            try:
                return int(value)
            except ValueError:
                logger.warning("ignoring non-integer %s=%r", key, value)
    return 0


def import_mpi() -> Any:
    """Import and return ``mpi4py.MPI``; ``ImportError`` with the install hint if missing."""
    try:
        from mpi4py import MPI
    except ImportError as exc:  # mpi4py absent, or present without an MPI library
        raise ImportError(f"the 'mpi' backend needs mpi4py and an MPI library; {INSTALL_HINT} ({exc})") from exc
    return MPI


def _transport_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class MPICommunicator(BucketedCommunicator):
    """:class:`~torchsso2.distributed.Communicator` over an ``mpi4py`` communicator.

    Args:
        comm: the world communicator, ``MPI.COMM_WORLD`` by default. Ranks are ranks in it.
    """

    def __init__(self, comm: Any | None = None) -> None:
        self._MPI = import_mpi()
        self.comm = self._MPI.COMM_WORLD if comm is None else comm
        super().__init__(rank=self.comm.Get_rank(), world_size=self.comm.Get_size())

    def barrier(self) -> None:
        """``MPI_Barrier`` over the world."""
        self.comm.Barrier()

    def _to_host(self, buffer: Tensor) -> tuple[Tensor, Any]:
        host = buffer.detach().to(device="cpu", dtype=_transport_dtype(buffer.dtype)).contiguous()
        return host, host.numpy()

    @staticmethod
    def _copy_back(host: Tensor, buffer: Tensor) -> None:
        if host.data_ptr() != buffer.data_ptr():
            buffer.copy_(host)

    def _allreduce_sum_(self, buffer: Tensor) -> int:
        host, array = self._to_host(buffer)
        self.comm.Allreduce(self._MPI.IN_PLACE, array, op=self._MPI.SUM)
        self._copy_back(host, buffer)
        return array.nbytes

    def _broadcast_(self, buffer: Tensor, src: int, members: tuple[int, ...], handle: Any) -> int:
        comm = self.comm if handle is None else handle
        host, array = self._to_host(buffer)
        comm.Bcast(array, root=members.index(src))
        self._copy_back(host, buffer)
        return array.nbytes

    def _make_group_handle(self, ranks: tuple[int, ...]) -> Any:
        member = self.rank in ranks
        color = 0 if member else self._MPI.UNDEFINED
        sub = self.comm.Split(color, key=self.rank)  # collective over the world
        return sub if member else None

    def __repr__(self) -> str:
        return f"MPICommunicator(rank={self.rank}, world_size={self.world_size})"


#: seconds an aborting rank waits after flushing its report, before ``MPI_Abort`` (crash path only)
ABORT_GRACE_S = 0.5


def install_abort_on_exception(comm: Any | None = None) -> _ExceptHook:
    """Make an uncaught exception abort the whole MPI job instead of hanging it.

    Replaces ``sys.excepthook`` by one that writes a one-line summary (rank, exception type and
    message) to stderr, reports the exception with the previous hook (so the traceback is
    printed), flushes stdout/stderr, waits :data:`ABORT_GRACE_S` for the launcher to forward
    them, and calls ``comm.Abort(1)``
    (``MPI_Abort``), which makes the launcher terminate every rank.

    Args:
        comm: an ``mpi4py`` communicator, an :class:`MPICommunicator`, or ``None`` for
            ``MPI.COMM_WORLD``.

    Returns:
        The previous ``sys.excepthook``, to restore it with ``sys.excepthook = previous``.
    """
    MPI = import_mpi()
    if isinstance(comm, MPICommunicator):
        comm = comm.comm
    target = MPI.COMM_WORLD if comm is None else comm
    previous: _ExceptHook = sys.excepthook

    def abort_hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:  # the one-line summary first: the launcher may drop the tail of an aborting rank's stderr
            sys.stderr.write(f"[rank {target.Get_rank()}] uncaught {exc_type.__name__}: {exc}; calling MPI_Abort\n")
            sys.stderr.flush()
            previous(exc_type, exc, tb)
            sys.stdout.flush()
            sys.stderr.flush()
            # the launcher forwards our output from a pipe; MPI_Abort tears it down, and on a busy
            # machine it dropped everything written (a CI run showed an aborted job with empty
            # stdout and stderr): give it a moment to forward the report first
            time.sleep(ABORT_GRACE_S)
        finally:
            target.Abort(1)

    sys.excepthook = abort_hook
    return previous
