"""``get_communicator``: pick the backend from an explicit name or from how we were launched."""

from __future__ import annotations

import logging
from enum import Enum

from curvature.options import did_you_mean

from torchsso2.distributed.communicator import Communicator
from torchsso2.distributed.local import LocalCommunicator
from torchsso2.distributed.faults import resolve_abort_on_exception, resolve_timeout
from torchsso2.distributed.mpi_backend import MPICommunicator, install_mpi_fault_handlers, mpi_launch_size
from torchsso2.distributed.torch_backend import TorchCommunicator, init_from_env, torchrun_world_size

logger = logging.getLogger(__name__)


class Backend(str, Enum):
    """Names accepted by :func:`get_communicator`."""

    AUTO = "auto"
    NONE = "none"
    TORCH = "torch"
    MPI = "mpi"

    @classmethod
    def parse(cls, name: str | Backend) -> Backend:
        """Return the member for ``name``; ``ValueError`` naming it and the choices if unknown."""
        try:
            return cls(name.strip().lower() if isinstance(name, str) else name)
        except ValueError:
            choices = [m.value for m in cls]
            raise ValueError(f"unknown communicator backend {name!r}{did_you_mean(name, choices)}; expected one of "
                             f"{', '.join(map(repr, choices))}") from None


def _torch_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _torch(timeout: float) -> TorchCommunicator:
    if not _torch_initialized():
        if torchrun_world_size() > 0:
            init_from_env(timeout)
        else:
            raise RuntimeError(
                "backend 'torch' but torch.distributed is not initialized and no torchrun "
                "environment (WORLD_SIZE, RANK, MASTER_ADDR) was found: call "
                "torch.distributed.init_process_group(...) or launch with torchrun"
            )
    return TorchCommunicator(timeout=timeout)


def get_communicator(backend: str | Backend = "auto", timeout: float | None = None,
                     abort_on_exception: bool | None = None, loglevel: int = logging.INFO) -> Communicator:
    """Return the communicator for this process.

    Args:
        backend: ``"auto"``, ``"none"`` (one process, no-op), ``"torch"`` or ``"mpi"``.
            ``"auto"`` picks, in this order: ``torch`` if ``torch.distributed`` is
            initialized; ``mpi`` if an MPI launcher announces more than one process
            (``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ``MPI_LOCALNRANKS``, ... read *before*
            ``mpi4py`` is imported); ``torch`` initialized from the environment if a
            ``torchrun`` environment announces more than one process; else ``none``.
        timeout: seconds a collective (and ``MPI_Init``) waits for the other ranks before it
            raises :class:`~torchsso2.distributed.faults.CollectiveTimeoutError` naming this
            rank and the cause; ``None``: the ``TORCHSSO2_DIST_TIMEOUT`` environment variable,
            else 60. Under torch it is also the process group's timeout when this function
            initializes the group.
        abort_on_exception: when MPI is selected, install the process-wide fault handlers
            (:func:`~torchsso2.distributed.mpi_backend.install_mpi_fault_handlers`: an uncaught
            exception calls ``MPI_Abort``; a rank that exits tells the others). ``None``
            (default): yes, unless ``TORCHSSO2_ABORT_ON_EXCEPTION=0``; ``False``: opt out.
        loglevel: level of the message that says what ``"auto"`` chose.

    Raises:
        ValueError: unknown ``backend`` (the message names it and the choices).
        ImportError: ``mpi`` requested or detected but ``mpi4py`` is missing.
        RuntimeError: ``torch`` requested but nothing initializes ``torch.distributed``.
    """
    choice = Backend.parse(backend)
    timeout = resolve_timeout(timeout)
    abort = resolve_abort_on_exception(abort_on_exception)
    if choice is Backend.AUTO:
        if _torch_initialized():
            choice = Backend.TORCH
        elif mpi_launch_size() > 1:
            choice = Backend.MPI
        elif torchrun_world_size() > 1:
            choice = Backend.TORCH
        else:
            choice = Backend.NONE
        logger.log(loglevel, "get_communicator('auto') chose %r", choice.value)

    if choice is Backend.NONE:
        return LocalCommunicator()
    if choice is Backend.TORCH:
        return _torch(timeout)
    comm = MPICommunicator(timeout=timeout)
    if abort and comm.world_size > 1:
        install_mpi_fault_handlers(comm)
    return comm
