"""Distributed layer shared by all optimizer faces.

* :class:`Communicator` — the protocol the optimizers call (``allreduce``, ``broadcast``,
  ``new_group``, ``barrier``, ``bytes_sent``); :func:`get_communicator` returns one of
  :class:`LocalCommunicator`, :class:`TorchCommunicator`, :class:`MPICommunicator`.
* :class:`WorkAssignment` — KAISA placement of inverse work and gradient workers.
* :func:`average_gradients` — the gradients' mean over the ranks as DDP takes it (for a plain
  model under ``mpiexec``, before ``KFACPreconditioner.step()``).

``mpi4py`` is imported only when an MPI communicator is made. See ``docs/distributed.md``.
"""

from torchsso2.distributed.assignment import (
    AssignmentStrategy,
    DistributedStrategy,
    WorkAssignment,
    compute_cost,
    memory_cost,
    parse_enum,
)
from torchsso2.distributed.communicator import BucketedCommunicator, Communicator, Group, ReduceOp
from torchsso2.distributed.consistency import check_same_settings
from torchsso2.distributed.faults import CollectiveTimeoutError
from torchsso2.distributed.gradients import average_gradients
from torchsso2.distributed.local import LocalCommunicator
from torchsso2.distributed.mpi_backend import MPICommunicator, install_abort_on_exception, install_mpi_fault_handlers
from torchsso2.distributed.select import Backend, get_communicator
from torchsso2.distributed.torch_backend import TorchCommunicator, shutdown

__all__ = [
    "AssignmentStrategy",
    "average_gradients",
    "Backend",
    "BucketedCommunicator",
    "CollectiveTimeoutError",
    "Communicator",
    "DistributedStrategy",
    "Group",
    "LocalCommunicator",
    "MPICommunicator",
    "ReduceOp",
    "TorchCommunicator",
    "WorkAssignment",
    "check_same_settings",
    "compute_cost",
    "get_communicator",
    "install_abort_on_exception",
    "install_mpi_fault_handlers",
    "memory_cost",
    "shutdown",
    "parse_enum",
]
