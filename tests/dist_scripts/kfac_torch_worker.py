"""gloo rank for tests/test_kfac_distributed.py: file:// init, model in DistributedDataParallel."""
from __future__ import annotations

import os
import sys
from datetime import timedelta

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import kfac_dist_common as common  # noqa: E402


def main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=90))
    try:
        from torchsso2.distributed import get_communicator

        comm = get_communicator("auto")
        results = common.run_rank(comm, lambda m: DDP(m))
        torch.save(results, os.path.join(out_dir, f"torch_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
