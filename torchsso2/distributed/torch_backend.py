"""Communicator over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Failure behaviour: every collective of this communicator is started with ``async_op=True``
and waited for with the communicator's ``timeout`` (whatever timeout the process group was
initialized with); groups made by :meth:`TorchCommunicator.new_group` get it too. A peer that
dies closes its connections and the others raise at once; a peer that hangs makes the others
raise when the timeout expires. Either way the error is a
:class:`~torchsso2.distributed.faults.CollectiveTimeoutError` naming this rank, the collective
and the cause, and no rank waits forever. (With NCCL, keep
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, the default in recent PyTorch, so that a timed-out
collective aborts the process.)
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torchsso2.distributed.communicator import BucketedCommunicator
from torchsso2.distributed.faults import CollectiveTimeoutError, resolve_timeout

logger = logging.getLogger(__name__)

#: seconds, at the end of the timeout (at most a quarter of it), in which a waiting rank looks for
#: the other members that timed out in the same collective, to name the missing ones
QUERY_WAIT_S = 2.0


def torchrun_world_size(env: dict[str, str] | None = None) -> int:
    """World size announced by a ``torchrun``-style environment, or 0 if there is none.

    Looks for ``WORLD_SIZE``, ``RANK`` and ``MASTER_ADDR`` (what ``torchrun`` and
    ``torch.distributed.launch`` export for the ``env://`` init method).
    """
    env = dict(os.environ) if env is None else env
    if not all(key in env for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR")):
        return 0
    try:
        return int(env["WORLD_SIZE"])
    except ValueError:
        return 0


def _group_timeout_s() -> float | None:
    """The default process group's timeout in seconds (gloo's backend options), None where it cannot be read."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return None


def init_from_env(timeout: float) -> None:
    """Initialize the default process group from a ``torchrun`` environment.

    Uses NCCL when CUDA is available, gloo otherwise, and ``timeout`` seconds.
    """
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    logger.info("initializing torch.distributed (%s, env://, timeout %.0f s)", backend, timeout)
    dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(seconds=timeout))
    # we created the group, so we also tear it down: a gloo group still alive at interpreter
    # shutdown can abort the process ("terminate called without an active exception")
    atexit.register(_destroy_process_group)


def shutdown() -> None:
    """End a ``torch.distributed`` run normally: wait for every rank, then destroy the default group.

    Call it at the end of a script run by ``torchrun``. Without the barrier a fast rank can tear
    its gloo connections down while a slower one is still finishing its last collective, which
    aborts the slower process at exit ("terminate called without an active exception"). A no-op
    when torch.distributed is not initialized (single process, or MPI).
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        # free finished work objects now, while the interpreter is whole: gloo aborts a process
        # whose worker threads still hold them at finalization (pytorch/pytorch#179291)
        gc.collect()


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            logger.debug("destroy_process_group at exit failed", exc_info=True)


class TorchCommunicator(BucketedCommunicator):
    """:class:`~torchsso2.distributed.Communicator` over an initialized ``torch.distributed``.

    Args:
        timeout: seconds a collective waits for the other ranks before raising
            :class:`~torchsso2.distributed.faults.CollectiveTimeoutError` (``None``: the
            ``TORCHSSO2_DIST_TIMEOUT`` environment variable, else 60); also the timeout of
            the groups made by :meth:`new_group`.

    Buffers stay on the tensors' device: CPU tensors need gloo (or MPI), CUDA tensors NCCL
    (or gloo). Means are computed as a sum divided by the world size, which every backend
    supports.
    """

    def __init__(self, timeout: float | None = None) -> None:
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this build of PyTorch")
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
                "first, or launch with torchrun and use get_communicator('torch')"
            )
        self.timeout = resolve_timeout(timeout)
        super().__init__(rank=dist.get_rank(), world_size=dist.get_world_size())
        self.backend_name = str(dist.get_backend())
        group_timeout = _group_timeout_s()
        if group_timeout is not None and group_timeout > self.timeout and self.backend_name != "nccl" \
                and self.world_size > 1 and self.rank == 0:  # one rank says it; a world of one has no other rank
            logger.warning("the process group's timeout (%.0f s) is longer than the communicator's (%.0f s): a stuck "
                           "rank raises CollectiveTimeoutError on the others after %.0f s, but their processes "
                           "cannot exit before the group's pending collective times out; pass "
                           "init_process_group(timeout=timedelta(seconds=%.0f)) (PyTorch Lightning: "
                           "DDPStrategy(timeout=...)) (docs/distributed.md)",
                           group_timeout, self.timeout, self.timeout, self.timeout)

    def barrier(self) -> None:
        """``torch.distributed.barrier`` over the world (bounded by ``timeout``)."""
        self._wait(dist.barrier(async_op=True), "barrier", tuple(range(self.world_size)))

    def _wait(self, work: Any, what: str, members: tuple[int, ...]) -> None:
        """Wait for ``work`` at most ``timeout`` s; a failure becomes a :class:`CollectiveTimeoutError`."""
        query_s = min(QUERY_WAIT_S, self.timeout / 4)  # the end of the timeout names the missing ranks
        try:
            if self.backend_name == "nccl":  # a timed wait would block the CPU on the stream; NCCL's
                work.wait()                  # watchdog enforces the group's timeout instead
            else:
                work.wait(timeout=timedelta(seconds=self.timeout - query_s))
        except RuntimeError as exc:
            text = str(exc)
            if "timed out" in text.lower() or "timeout" in text.lower():
                cause = (f"did not complete within {self.timeout:g} s: {self._missing(what, members, query_s)}. If a rank "
                         f"legitimately works alone this long, raise the timeout "
                         f"(get_communicator(timeout=...) or TORCHSSO2_DIST_TIMEOUT, seconds)")
            else:
                cause = "failed: another rank exited or crashed (its connection closed)"
            raise CollectiveTimeoutError(f"rank {self.rank}: {what} over ranks {list(members)} {cause} "
                                         f"[{self.backend_name}: {text.strip()[:300]}]") from exc

    def _missing(self, what: str, members: tuple[int, ...], query_s: float) -> str:
        """Who had not reached a timed-out collective: every rank that times out in it writes a key
        to the process group's store; those whose key does not appear within ``query_s`` seconds
        are named (ranks that entered much later would be named too)."""
        generic = "another rank hung, crashed or exited before reaching it"
        try:
            store = dist.distributed_c10d._get_default_store()
            key = f"torchsso2/timed_out/{self._num_collectives}/{what}"
            store.set(f"{key}/{self.rank}", "1")
            others = [q for q in members if q != self.rank]
            seen: set = set()
            end = time.monotonic() + query_s
            while time.monotonic() < end and len(seen) < len(others):
                seen |= {q for q in others if q not in seen and store.check([f"{key}/{q}"])}
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - no store, or it is gone too: say what we know
            logger.debug("could not ask the store who timed out", exc_info=True)
            return generic
        silent = [q for q in others if q not in seen]
        if not silent:
            return "every rank timed out in it; the collective itself is stuck"
        waiting = [q for q in others if q in seen]
        return (f"{'rank' if len(silent) == 1 else 'ranks'} {', '.join(map(str, silent))} had not reached it "
                f"(hung, crashed, exited, or busy outside torchsso2's collectives)"
                + (f"; {'rank' if len(waiting) == 1 else 'ranks'} {', '.join(map(str, waiting))} timed out in it too"
                   if waiting else ""))

    def _allreduce_sum_(self, buffer: Tensor) -> int:
        self._wait(dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True), "allreduce",
                   tuple(range(self.world_size)))
        return buffer.numel() * buffer.element_size()

    def _broadcast_(self, buffer: Tensor, src: int, members: tuple[int, ...], handle: Any) -> int:
        self._wait(dist.broadcast(buffer, src=src, group=handle, async_op=True), f"broadcast from rank {src}",
                   members)
        return buffer.numel() * buffer.element_size()

    def _make_group_handle(self, ranks: tuple[int, ...]) -> Any:
        group = dist.new_group(ranks=list(ranks), timeout=timedelta(seconds=self.timeout))
        return group if self.rank in ranks else None

    def __repr__(self) -> str:
        return (
            f"TorchCommunicator(rank={self.rank}, world_size={self.world_size}, "
            f"backend={self.backend_name!r})"
        )
