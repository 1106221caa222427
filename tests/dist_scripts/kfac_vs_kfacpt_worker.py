"""gloo rank for tests/test_kfac_vs_kfac_pytorch_distributed.py: the same DDP training with
kfac_pytorch's KFACPreconditioner and with ours; saves both preconditioned-gradient traces."""
from __future__ import annotations

import copy
import os
import sys
import warnings
from datetime import timedelta

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import kfac_dist_common as common  # noqa: E402

CONFIGS = {
    "comm_opt-eigen": dict(grad_worker_fraction=1.0, compute_method="eigen"),
    "mem_opt-inverse": dict(grad_worker_fraction=0.5, compute_method="inverse"),
    "hybrid-eigen-noprediv": dict(grad_worker_fraction=0.5, compute_method="eigen",
                                  compute_eigenvalue_outer_product=False),
}


def main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=90))
    try:
        import kfac.enums
        import kfac.preconditioner

        from torchsso2.kfac import KFACPreconditioner

        results = {}
        base = dict(damping=0.01, lr=0.1, kl_clip=0.01, factor_decay=0.9)
        for name, cfg in CONFIGS.items():
            torch.manual_seed(0)
            model = common.ConvNet().float()
            traces = {}
            for who in ("theirs", "ours"):
                m = DDP(copy.deepcopy(model))
                if who == "theirs":
                    kw = dict(cfg, compute_method=kfac.enums.ComputeMethod[cfg["compute_method"].upper()])
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        pre = kfac.preconditioner.KFACPreconditioner(m, **base, **kw)
                else:
                    pre = KFACPreconditioner(m, **base, **cfg)
                shard = lambda s: [tuple(t.float() if t.is_floating_point() else t  # noqa: E731
                                         for t in common.shard(s, rank))]
                traces[who] = common.train(m, pre, shard)
            results[name] = traces
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
