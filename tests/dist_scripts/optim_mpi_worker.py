"""MPI rank for tests/test_distributed_optim.py: ``mpiexec -n W python optim_mpi_worker.py OUT_DIR [fail]``.

Saves ``mpi_rank{r}.pt`` with the results of every configuration. With ``fail``, rank 1 then
raises inside its closure: ``install_abort_on_exception`` turns that into ``MPI_Abort``, so
the whole job ends at once with a non-zero exit instead of rank 0 waiting forever.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import torch  # noqa: E402

import optim_common as common  # noqa: E402
from torchsso2.distributed import MPICommunicator, get_communicator, install_abort_on_exception  # noqa: E402


def main(out_dir: str, fail: bool) -> None:
    torch.set_num_threads(1)
    comm = get_communicator("auto")
    assert isinstance(comm, MPICommunicator), comm
    install_abort_on_exception(comm)
    results = common.run_rank(comm)
    torch.save(results, os.path.join(out_dir, f"mpi_rank{comm.rank}.pt"))
    if fail:
        comm.barrier()
        common.failing_run(comm)
        # rank 0 never gets here: MPI_Abort from rank 1 ends the job
        print(f"rank {comm.rank}: failing run returned", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "fail")
