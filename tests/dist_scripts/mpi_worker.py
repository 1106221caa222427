"""Launched by tests/test_distributed_comm.py as ``mpiexec -n W python mpi_worker.py MODE OUT_DIR``.

Modes:
  checks  run the collective checks of comm_checks.py with get_communicator('auto'),
          which must pick MPI from the launcher's environment.
  raise   install_abort_on_exception(); rank 1 raises while rank 0 waits in an allreduce;
          the job must end with a non-zero exit instead of hanging.
"""

from __future__ import annotations

import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # comm_checks
sys.path.insert(1, os.path.dirname(os.path.dirname(_HERE)))  # the repository root (torchsso2)

import torch  # noqa: E402
from comm_checks import run_checks  # noqa: E402

from torchsso2.distributed import MPICommunicator, get_communicator, install_abort_on_exception  # noqa: E402


def main(mode: str, out_dir: str) -> None:
    comm = get_communicator("auto")
    assert isinstance(comm, MPICommunicator), comm
    if mode == "checks":
        run_checks(comm, out_dir, "mpi")
        return
    if mode == "raise":
        install_abort_on_exception(comm)
        comm.allreduce([torch.ones(4)])
        if comm.rank == 1:
            time.sleep(0.5)
            raise RuntimeError("rank 1 fails on purpose")
        comm.allreduce([torch.ones(1000)])  # never completes: rank 1 is gone
        return
    raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
