"""KFACPreconditioner resumed on another number of ranks (tests/test_kfac_elastic.py), gloo under DDP.

``main(rank, world_size, init_file, out_dir, phase)``: phase ``"save"`` trains 5 steps (factors every 2,
decompositions every 3: the decompositions in use are older than the saved factors) and each rank saves
its own ``state_dict()``; phase ``"load"`` makes rank ``r`` load rank ``r % 2``'s file (a job resumed on
more ranks from per-rank files), trains 3 more steps and records the weights after each.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

GLOBAL_BATCH = 16


def main(rank: int, world_size: int, init_file: str, out_dir: str, phase: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchsso2.kfac import DistributedStrategy, KFACPreconditioner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        pre = KFACPreconditioner(ddp, grad_worker_fraction=DistributedStrategy.HYBRID_OPT, factor_update_steps=2,
                                 inv_update_steps=3, inv_dtype=torch.float64)

        def step(s: int) -> None:
            g = torch.Generator().manual_seed(s)
            x = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)
            y = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
            n = GLOBAL_BATCH // world_size
            opt.zero_grad()
            F.cross_entropy(ddp(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
            pre.step()
            opt.step()

        if phase == "save":
            for s in range(5):
                step(s)
            torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), pre=pre.state_dict()),
                       os.path.join(out_dir, f"ckpt{rank}.pt"))
            dist.barrier()  # every rank done before the group goes (torch 2.5's gloo could hang a rank at exit)
            return
        ckpt = torch.load(os.path.join(out_dir, f"ckpt{rank % 2}.pt"), weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        pre.load_state_dict(ckpt["pre"])
        rows = []
        for s in range(5, 8):
            step(s)
            rows.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        torch.save(torch.stack(rows), os.path.join(out_dir, f"weights{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
