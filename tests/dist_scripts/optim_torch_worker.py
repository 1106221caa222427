"""gloo rank for tests/test_distributed_optim.py: ``file://`` init, then every configuration.

``mode="normal"``: saves ``torch_rank{r}.pt`` with the results of every configuration, then
runs the failure check: rank 1 raises inside its closure, rank 0 records the error its
collective raised (``fail_rank0.pt``) and exits normally; rank 1 exits with code 1.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import optim_common as common  # noqa: E402

TIMEOUT_S = 30


def main(rank: int, world_size: int, init_file: str, out_dir: str, with_failure: bool = True) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=TIMEOUT_S))
    from torchsso2.distributed import get_communicator

    comm = get_communicator("auto", timeout=TIMEOUT_S)
    results = common.run_rank(comm)
    torch.save(results, os.path.join(out_dir, f"torch_rank{rank}.pt"))
    if not with_failure:
        dist.destroy_process_group()
        return
    comm.barrier()
    seen = common.failing_run(comm)  # rank 1 raises out of here: its process dies, sockets close
    torch.save(seen, os.path.join(out_dir, f"fail_rank{rank}.pt"))
