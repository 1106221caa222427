"""Keep an MPI job from hanging when one rank fails: init watchdog and exit notices.

MPI has no timeouts of its own, and a rank that leaves early leaves its peers blocked:

* a rank that exits (``sys.exit(3)``, the end of its script) runs ``MPI_Finalize``, which
  waits for the others while they wait in a collective for it;
* a rank that exits *before* initializing MPI leaves the others blocked in ``MPI_Init``.

:func:`install_exit_notice` (installed by the library when it selects MPI) registers an
``atexit`` handler that sends every other rank a short *exit notice* on a private duplicate
of the world communicator. The :class:`~torchsso2.distributed.MPICommunicator` polls its
collectives (``Iallreduce``/``Ibcast``/``Ibarrier`` + ``Test``) and reads those notices while
it waits, so a rank left waiting for a peer that has gone raises
:class:`~torchsso2.distributed.faults.CollectiveTimeoutError` naming it (after
:data:`EXIT_GRACE_S`, in case the peer's last message is still in flight), which the abort
hook turns into ``MPI_Abort``. :func:`init_watchdog` bounds ``MPI_Init`` with a tiny watchdog
process (``MPI_Init`` holds the GIL, so no Python thread could).

The notice handler is process-wide state by nature (like ``sys.excepthook``): it is made once
per process, for ``MPI.COMM_WORLD``, and later calls return the same object.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

#: seconds a rank keeps waiting for a collective after a member announced its exit (its last
#: messages may still be in flight when the notice arrives)
EXIT_GRACE_S = 1.0

#: tags on the private communicator: exit notices, "who is waiting?" queries and their replies
NOTICE_TAG = 0x5EED
QUERY_TAG = 0x5EEE
REPLY_TAG = 0x5EEF

_WATCHDOG = r"""
import os, select, signal, sys, time
pid, timeout, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], timeout)
if ready:  # the parent closed the pipe: MPI_Init returned (or the parent died)
    sys.exit(0)
sys.stderr.write(message + "\n")
sys.stderr.flush()
time.sleep(0.5)
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        sys.exit(0)
    time.sleep(2.0)
"""


@contextlib.contextmanager
def init_watchdog(timeout: float, rank: int, world_size: int) -> Iterator[None]:
    """Kill this process with a message if the block (``MPI_Init``) lasts longer than ``timeout`` s.

    ``MPI_Init`` waits for every rank of the launch; a rank that exited before initializing
    MPI would keep it waiting forever. The watchdog is a separate small process (``MPI_Init``
    holds the GIL) that is told to stop by closing its stdin.
    """
    message = (f"[rank {rank}] MPI_Init did not complete within {timeout:g} s: not every one of the "
               f"{world_size} ranks initialized MPI (a rank exited or failed before initializing MPI, "
               f"or hangs); terminating rank {rank}. Set TORCHSSO2_DIST_TIMEOUT (seconds) or "
               f"get_communicator(timeout=...) if the ranks legitimately start this far apart.")
    try:
        dog = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(timeout), message],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
    except OSError as exc:  # pragma: no cover - no process could be started
        logger.warning("rank %d: could not start the MPI_Init watchdog (%s); MPI_Init is not bounded", rank, exc)
        yield
        return
    try:
        yield
    finally:
        assert dog.stdin is not None
        dog.stdin.close()
        dog.wait()


class ExitNotices:
    """Exit notices between the ranks of ``MPI.COMM_WORLD`` (see the module docstring).

    Args:
        world: ``MPI.COMM_WORLD`` (an ``mpi4py`` communicator); duplicated here, collectively.
        MPI: the ``mpi4py.MPI`` module.
    """

    def __init__(self, world: Any, MPI: Any) -> None:
        self._MPI = MPI
        self.comm = world.Dup()  # private: user traffic on COMM_WORLD cannot steal a notice
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.exited: Dict[int, str] = {}
        self._lock = threading.Lock()
        self._announced = False
        self._sends: List[Any] = []  # requests of sent messages, kept alive until they complete

    def _receive(self, tag: int) -> Iterator[Tuple[int, Any]]:
        status = self._MPI.Status()
        while self.comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=tag, status=status):
            src = status.Get_source()
            yield src, self.comm.recv(source=src, tag=tag)

    def _send(self, message: Any, dest: int, tag: int) -> None:
        self._sends = [r for r in self._sends if not r.Test()]
        self._sends.append(self.comm.isend(message, dest=dest, tag=tag))

    def poll(self, waiting_in: Optional[str] = None) -> Dict[int, str]:
        """Receive the notices that have arrived; return ``{rank: why}`` of every rank that exited.

        ``waiting_in``: the collective this rank is waiting in; queries of ranks that timed out
        are then answered with it (see :meth:`who_waits`).
        """
        with self._lock:
            if self._announced:
                return self.exited
            for src, why in self._receive(NOTICE_TAG):
                self.exited[src] = str(why)
            if waiting_in is not None:
                for src, _ in self._receive(QUERY_TAG):
                    self._send(waiting_in, src, REPLY_TAG)
            return self.exited

    def who_waits(self, members: Sequence[int], waiting_in: str, wait_s: float,
                  done: Optional[Callable[[], bool]] = None) -> Optional[Dict[int, str]]:
        """Ask the other ``members`` what they wait in; return ``{rank: answer}`` of those that
        answered within ``wait_s`` seconds, or ``None`` as soon as ``done()`` is true (the
        collective completed meanwhile). A rank answers only from inside a torchsso2
        collective, so one that does not answer hangs or works outside them."""
        with self._lock:
            for q in members:
                if q != self.rank:
                    self._send(waiting_in, q, QUERY_TAG)
        answers: Dict[int, str] = {}
        end = time.monotonic() + wait_s
        others = {q for q in members if q != self.rank}
        while time.monotonic() < end and not others <= set(answers) | set(self.exited):
            if done is not None and done():
                return None
            self.poll(waiting_in)  # answer the others' queries too: they may have timed out as well
            with self._lock:
                for src, answer in self._receive(REPLY_TAG):
                    answers[src] = str(answer)
            time.sleep(5e-3)
        return answers

    def announce_exit(self, why: str = "its Python interpreter is exiting (sys.exit, or the end of the script)") -> None:
        """Tell every rank that has not exited that this one is leaving (at most once; never blocks long)."""
        self.poll()
        with self._lock:
            if self._announced or self._MPI.Is_finalized():
                return
            self._announced = True
            requests = [self.comm.isend(why, dest=q, tag=NOTICE_TAG)
                        for q in range(self.world_size) if q != self.rank and q not in self.exited]
            end = time.monotonic() + 1.0
            while requests and time.monotonic() < end:  # small messages go eagerly: done at once
                requests = [r for r in requests if not r.Test()]
                if requests:
                    time.sleep(1e-3)


def install_exit_notice(world: Any, MPI: Any) -> ExitNotices:
    """The process's :class:`ExitNotices` for ``world``, made and registered with ``atexit`` once."""
    global _NOTICES  # process-wide by nature, like sys.excepthook and atexit itself
    if _NOTICES is None:
        notices = ExitNotices(world, MPI)
        atexit.register(notices.announce_exit)  # runs before mpi4py's MPI_Finalize (registered earlier)
        _NOTICES = notices
    return _NOTICES


def current_exit_notices() -> Optional[ExitNotices]:
    """The installed :class:`ExitNotices`, or ``None``."""
    return _NOTICES


_NOTICES: Optional[ExitNotices] = None

__all__ = ["EXIT_GRACE_S", "ExitNotices", "current_exit_notices", "init_watchdog", "install_exit_notice"]
