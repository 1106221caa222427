"""gloo rank for tests/test_kfac_compat.py: kfac_pytorch's distributed user scenarios against torchsso2.kfac.

Each rank records the resolved grad-worker fraction / strategy of several arguments, the
warnings and errors, and a 20-step training run (kfac_pytorch's training_test settings), then
saves them to ``out_dir/rank{rank}.pt``.
"""
from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from kfac_tiny import Tiny  # noqa: E402


def scenarios(world_size: int) -> dict:
    import torchsso2.kfac as kfac

    out = {}
    for name, value in (("zero", 0), ("half", 0.5), ("one", 1), ("hybrid", kfac.enums.DistributedStrategy.HYBRID_OPT),
                        ("mem", kfac.enums.DistributedStrategy.MEM_OPT),
                        ("bad", 0.75 if world_size == 2 else 0.3)):  # 1.5 or 1.2 grad workers
        try:
            pre = kfac.preconditioner.KFACPreconditioner(Tiny(), grad_worker_fraction=value)
            out[name] = (pre.grad_worker_fraction, pre.distributed_strategy.name)
        except ValueError as exc:
            out[name] = ("ValueError", str(exc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = kfac.preconditioner.KFACPreconditioner(Tiny(), compute_method="inverse", colocate_factors=False,
                                                     grad_worker_fraction=0)
    out["mem_no_colocation"] = (pre.colocate_factors, [str(w.message) for w in caught])
    return out


def train(grad_worker_fraction: float) -> list:
    """kfac_pytorch's training_test: 20 SGD steps on one random batch, K-FAC every 5 / 10 steps."""
    import torchsso2.kfac as kfac

    torch.manual_seed(dist.get_rank())
    x, y = torch.rand(4, 10), torch.rand(4, 10)
    dist.all_reduce(x)
    dist.all_reduce(y)
    model = nn.parallel.DistributedDataParallel(Tiny())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = kfac.preconditioner.KFACPreconditioner(model, factor_update_steps=5, inv_update_steps=10,
                                                 grad_worker_fraction=grad_worker_fraction, allreduce_bucket_cap_mb=0,
                                                 update_factors_in_hook=False)
    criterion = nn.MSELoss(reduction="sum")
    losses = []
    for _ in range(20):
        loss = criterion(model(x), y)
        losses.append(loss.item())
        loss.backward()
        pre.step()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=90))
    try:
        results = {"scenarios": scenarios(world_size), "losses": train(0.5), "losses_mem": train(0)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
