"""``get_communicator``: pick the backend from an explicit name or from how we were launched."""

from __future__ import annotations

import logging
from enum import Enum

from torchsso2.distributed.communicator import Communicator
from torchsso2.distributed.local import LocalCommunicator
from torchsso2.distributed.mpi_backend import MPICommunicator, mpi_launch_size
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
            return cls(name)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"unknown communicator backend {name!r}; expected one of {choices}") from None


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


def get_communicator(backend: str | Backend = "auto", timeout: float = 300.0,
                     loglevel: int = logging.INFO) -> Communicator:
    """Return the communicator for this process.

    Args:
        backend: ``"auto"``, ``"none"`` (one process, no-op), ``"torch"`` or ``"mpi"``.
            ``"auto"`` picks, in this order: ``torch`` if ``torch.distributed`` is
            initialized; ``mpi`` if an MPI launcher announces more than one process
            (``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ``MPI_LOCALNRANKS``, ... read *before*
            ``mpi4py`` is imported); ``torch`` initialized from the environment if a
            ``torchrun`` environment announces more than one process; else ``none``.
        timeout: seconds before a stuck ``torch.distributed`` collective raises (used
            when this function initializes the process group, and for new groups). MPI
            has no timeouts; see :func:`install_abort_on_exception`.
        loglevel: level of the message that says what ``"auto"`` chose.

    Raises:
        ValueError: unknown ``backend`` (the message names it and the choices).
        ImportError: ``mpi`` requested or detected but ``mpi4py`` is missing.
        RuntimeError: ``torch`` requested but nothing initializes ``torch.distributed``.
    """
    choice = Backend.parse(backend)
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
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
    return MPICommunicator()
