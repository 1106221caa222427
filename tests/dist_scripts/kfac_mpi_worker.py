"""MPI rank for tests/test_kfac_distributed.py: ``mpiexec -n W python kfac_mpi_worker.py OUT_DIR``.

No DistributedDataParallel here (torch.distributed is not initialized): the gradients are
averaged with the MPI communicator's all-reduce, which is what DDP does.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import torch  # noqa: E402

import kfac_dist_common as common  # noqa: E402
from torchsso2.distributed import MPICommunicator, get_communicator, install_abort_on_exception  # noqa: E402


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    comm = get_communicator("auto")
    assert isinstance(comm, MPICommunicator), comm
    install_abort_on_exception(comm)
    results = common.run_rank(comm, lambda m: m, average=lambda grads: comm.allreduce(grads, op="mean"))
    torch.save(results, os.path.join(out_dir, f"mpi_rank{comm.rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
