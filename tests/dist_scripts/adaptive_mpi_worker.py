"""MPI rank for tests/test_adaptive_distributed.py: ``mpiexec -n W python adaptive_mpi_worker.py OUT_DIR``.

Saves ``adaptive_rank{r}.pt`` with the results of every configuration of adaptive_common.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import torch  # noqa: E402

import adaptive_common  # noqa: E402
from torchsso2.distributed import MPICommunicator, get_communicator, install_abort_on_exception  # noqa: E402


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    comm = get_communicator("auto")
    assert isinstance(comm, MPICommunicator), comm
    install_abort_on_exception(comm)
    torch.save(adaptive_common.run_rank(comm), os.path.join(out_dir, f"adaptive_rank{comm.rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
