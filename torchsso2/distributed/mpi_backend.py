"""Communicator over ``mpi4py``: numpy buffers, ``Allreduce`` and ``Bcast``.

Each bucket is moved to a contiguous CPU numpy array (float16 and bfloat16 travel as
float32, which MPI reduces portably), reduced or broadcast in place, and copied back to
the tensors' device and dtype.

Failure behaviour: MPI has no timeouts, so this communicator makes its own. Every collective
is started non-blocking (``Iallreduce``, ``Ibcast``, ``Ibarrier``) and polled with ``Test``
until it completes, a member announces its exit (see :mod:`~torchsso2.distributed.mpi_guard`),
or ``timeout`` seconds pass; then :class:`~torchsso2.distributed.faults.CollectiveTimeoutError`
names this rank, the collective and the cause. A process that *dies* is noticed by the
launcher (``mpiexec`` of MPICH/hydra and Open MPI kill the remaining ranks), but a rank that
*raises* would run Python's exit handlers, ``MPI_Finalize`` among them, while its peers wait:
:func:`install_abort_on_exception` (installed by :func:`~torchsso2.distributed.get_communicator`
when it selects MPI, unless opted out) makes an uncaught exception print its traceback and call
``MPI_Abort``, which takes the whole job down with a non-zero exit.
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
from torchsso2.distributed.faults import CollectiveTimeoutError, launcher_rank, resolve_timeout
from torchsso2.distributed.mpi_guard import (
    EXIT_GRACE_S,
    ExitNotices,
    current_exit_notices,
    init_watchdog,
    install_exit_notice,
)

logger = logging.getLogger(__name__)

MPI_SIZE_ENV_VARS: tuple[str, ...] = (
    "OMPI_COMM_WORLD_SIZE",  # Open MPI
    "PMI_SIZE",  # MPICH / hydra, Intel MPI, srun --mpi=pmi2
    "MPI_LOCALNRANKS",  # MPICH
    "PMIX_SIZE",  # PMIx launchers
    "MV2_COMM_WORLD_SIZE",  # MVAPICH2
)
"""Environment variables through which MPI launchers announce the world size."""

INSTALL_HINT = "`pip install mpi4py mpich` (mpich: an MPI library with `mpiexec`; skip it where a system MPI is installed)"

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


def import_mpi(timeout: float | None = None) -> Any:
    """Import and return ``mpi4py.MPI``; ``ImportError`` with the install hint if missing.

    Importing it initializes MPI, which waits for every rank of the launch. When an MPI
    launcher announces more than one rank and MPI is not initialized yet, that wait is bounded
    by ``timeout`` seconds (default: :func:`~torchsso2.distributed.faults.resolve_timeout`),
    after which the process is terminated with a message (:func:`~torchsso2.distributed.mpi_guard.init_watchdog`).
    """
    try:
        if "mpi4py.MPI" not in sys.modules and mpi_launch_size() > 1:
            with init_watchdog(resolve_timeout(timeout), launcher_rank(), mpi_launch_size()):
                from mpi4py import MPI
        else:
            from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:  # mpi4py absent, or present without an MPI library (mpi4py 4
        # raises RuntimeError "cannot load MPI library" then)
        raise ImportError(f"the 'mpi' backend needs mpi4py and an MPI library; {INSTALL_HINT} ({exc})") from exc
    return MPI


#: seconds a collective is polled without sleeping (a blocking MPI call spins too); after that
#: the poll sleeps up to 1 ms between tests, which only a rank waiting for a slower one pays
SPIN_S = 0.02

#: seconds, at the end of the timeout (at most a quarter of it), in which a waiting rank asks
#: the other members what they wait in, to name the missing ones
QUERY_WAIT_S = 2.0


def _transport_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class MPICommunicator(BucketedCommunicator):
    """:class:`~torchsso2.distributed.Communicator` over an ``mpi4py`` communicator.

    Args:
        comm: the world communicator, ``MPI.COMM_WORLD`` by default. Ranks are ranks in it.
        timeout: seconds a collective may wait for the other ranks before
            :class:`~torchsso2.distributed.faults.CollectiveTimeoutError` (``None``: the
            ``TORCHSSO2_DIST_TIMEOUT`` environment variable, else 60).
        notices: the process's :class:`~torchsso2.distributed.mpi_guard.ExitNotices` (read
            while waiting, so a peer that exited is named within about a second), or ``None``.
    """

    def __init__(self, comm: Any | None = None, timeout: float | None = None,
                 notices: ExitNotices | None = None) -> None:
        self.timeout = resolve_timeout(timeout)
        self._MPI = import_mpi(self.timeout)
        self.comm = self._MPI.COMM_WORLD if comm is None else comm
        self.notices = notices
        super().__init__(rank=self.comm.Get_rank(), world_size=self.comm.Get_size())

    def barrier(self) -> None:
        """``MPI_Ibarrier`` over the world, polled until done (bounded by ``timeout``)."""
        self._wait(self.comm.Ibarrier(), "barrier", tuple(range(self.world_size)))

    def _wait(self, request: Any, what: str, members: tuple[int, ...]) -> None:
        """Poll ``request`` until it completes; raise :class:`CollectiveTimeoutError` when a member
        announced its exit (after :data:`EXIT_GRACE_S`) or after ``timeout`` seconds."""
        if request.Test():
            return
        start = time.monotonic()
        query_s = min(QUERY_WAIT_S, self.timeout / 4) if self.notices is not None else 0.0
        deadline, grace_end, next_look, pause = start + self.timeout - query_s, None, start, 0.0
        while not request.Test():
            now = time.monotonic()
            if now - start > SPIN_S:  # spin like a blocking MPI call would, then sleep a little between tests
                pause = min(1e-3, pause * 2 if pause else 2e-5)
                time.sleep(pause)
            if self.notices is not None and now >= next_look:
                next_look = now + 0.02
                gone = {q: why for q, why in self.notices.poll(what).items() if q in members and q != self.rank}
                if gone and grace_end is None:
                    grace_end = now + EXIT_GRACE_S
                elif gone and now > grace_end:
                    named = "; ".join(f"rank {q} exited: {why}" for q, why in sorted(gone.items()))
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: {what} over ranks {list(members)} cannot complete: {named}")
            if now > deadline:
                missing = self._missing(what, members, query_s, request)
                if missing is None:  # completed while we asked around
                    return
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: {what} over ranks {list(members)} did not complete within "
                    f"{self.timeout:g} s: {missing}. If a rank legitimately works "
                    "alone this long, raise the timeout (get_communicator(timeout=...) or "
                    "TORCHSSO2_DIST_TIMEOUT, seconds)")

    def _missing(self, what: str, members: tuple[int, ...], query_s: float, request: Any) -> str | None:
        """Who is missing from a timed-out collective, as far as the exit notices and a query of
        ``query_s`` seconds tell; ``None`` if ``request`` completed meanwhile."""
        if self.notices is None:
            return "another rank hung, crashed or exited before reaching it"
        answers = self.notices.who_waits(members, what, query_s, done=request.Test)
        if answers is None:
            return None
        gone = {q: why for q, why in self.notices.exited.items() if q in members}
        silent = [q for q in members if q != self.rank and q not in answers and q not in gone]
        parts = []
        if silent:
            parts.append(f"{'rank' if len(silent) == 1 else 'ranks'} {', '.join(map(str, silent))} did not reach "
                         "it (hung, or busy outside torchsso2's collectives)")
        parts += [f"rank {q} exited: {why}" for q, why in sorted(gone.items())]
        parts += [f"rank {q} waits in {answer}" for q, answer in sorted(answers.items())]
        return "; ".join(parts) if parts else "every rank answered; the collective itself is stuck"

    def _to_host(self, buffer: Tensor) -> tuple[Tensor, Any]:
        host = buffer.detach().to(device="cpu", dtype=_transport_dtype(buffer.dtype)).contiguous()
        return host, host.numpy()

    @staticmethod
    def _copy_back(host: Tensor, buffer: Tensor) -> None:
        if host.data_ptr() != buffer.data_ptr():
            buffer.copy_(host)

    def _allreduce_sum_(self, buffer: Tensor) -> int:
        host, array = self._to_host(buffer)
        self._wait(self.comm.Iallreduce(self._MPI.IN_PLACE, array, op=self._MPI.SUM), "allreduce",
                   tuple(range(self.world_size)))
        self._copy_back(host, buffer)
        return array.nbytes

    def _broadcast_(self, buffer: Tensor, src: int, members: tuple[int, ...], handle: Any) -> int:
        comm = self.comm if handle is None else handle
        host, array = self._to_host(buffer)
        self._wait(comm.Ibcast(array, root=members.index(src)), f"broadcast from rank {src}", members)
        self._copy_back(host, buffer)
        return array.nbytes

    def _make_group_handle(self, ranks: tuple[int, ...]) -> Any:
        member = self.rank in ranks
        color = 0 if member else self._MPI.UNDEFINED
        self.barrier()  # bounded: Split itself blocks, so first make sure every rank got here
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
        The previous ``sys.excepthook``, to restore it with ``sys.excepthook = previous``. When
        such a hook is installed already (:func:`~torchsso2.distributed.get_communicator` installs
        one when it selects MPI), nothing is installed and the hook it replaced is returned.
    """
    MPI = import_mpi()
    if isinstance(comm, MPICommunicator):
        comm = comm.comm
    target = MPI.COMM_WORLD if comm is None else comm
    if getattr(sys.excepthook, "torchsso2_abort_hook", False):  # installed already (e.g. by get_communicator)
        return sys.excepthook.previous  # type: ignore[attr-defined, no-any-return]
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

    abort_hook.torchsso2_abort_hook = True  # type: ignore[attr-defined]  # a second call installs nothing
    abort_hook.previous = previous  # type: ignore[attr-defined]
    sys.excepthook = abort_hook
    return previous


def install_mpi_fault_handlers(comm: MPICommunicator) -> None:
    """What the library installs when it selects MPI (opt out: ``TORCHSSO2_ABORT_ON_EXCEPTION=0``).

    * :func:`install_abort_on_exception`, unless ``sys.excepthook`` already is such a hook;
    * the process's exit notices (:func:`~torchsso2.distributed.mpi_guard.install_exit_notice`):
      a rank that exits tells the others, which stop waiting for it.

    Collective over ``comm``'s world the first time (every rank calls it at the same point);
    later calls only attach the existing notices to ``comm``.
    """
    install_abort_on_exception(comm)  # once: a second call installs nothing
    MPI = comm._MPI
    same_world = MPI.Comm.Compare(comm.comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT)  # notices use world ranks
    if comm.world_size > 1 and comm.notices is None and same_world:
        existing = current_exit_notices()
        if existing is None:
            comm.barrier()  # bounded; the duplication below blocks
        comm.notices = existing if existing is not None else install_exit_notice(MPI.COMM_WORLD, MPI)
