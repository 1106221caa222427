"""Entry points for gloo processes spawned by tests/test_distributed_comm.py.

Each function takes ``rank`` first (``torch.multiprocessing`` convention) and is imported by
the spawned child from this module, so they must stay top-level.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # comm_checks
sys.path.insert(1, os.path.dirname(os.path.dirname(_HERE)))  # the repository root (torchsso2)

from comm_checks import run_checks  # noqa: E402

from torchsso2.distributed import TorchCommunicator, get_communicator  # noqa: E402


def checks_file_init(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Init gloo from a file:// store, then run the collective checks."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        comm = get_communicator("auto", timeout=60)
        assert isinstance(comm, TorchCommunicator), comm
        run_checks(comm, out_dir, "torch")
    finally:
        dist.destroy_process_group()


def checks_env_init(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Pretend to be launched by torchrun: get_communicator('auto') must init from env://."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    comm = get_communicator("auto", timeout=60)
    assert isinstance(comm, TorchCommunicator), comm
    try:
        run_checks(comm, out_dir, "torchenv")
    finally:
        dist.destroy_process_group()


def failing(rank: int, world_size: int, init_file: str, out_dir: str, mode: str, timeout_s: float) -> None:
    """Rank 1 fails (``mode='raise'``) or hangs (``mode='hang'``); rank 0 must error out."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    comm = get_communicator("torch", timeout=timeout_s)
    import torch

    comm.allreduce([torch.ones(4)])  # everyone is up
    if rank == 1:
        if mode == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        time.sleep(120)  # hang; the test kills us
        return
    start = time.monotonic()
    try:
        comm.allreduce([torch.ones(1000)])
    except Exception as exc:  # report what rank 0 saw, then fail
        with open(os.path.join(out_dir, "rank0_error.txt"), "w") as fh:
            fh.write(f"{time.monotonic() - start:.2f}\n{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise
