"""SecondOrderOptimizer / VIOptimizer resumed on another number of ranks (tests/test_kfac_elastic.py).

``main(rank, world_size, init_file, out_dir, phase)`` (gloo, the model in DDP): phase ``"save"`` trains 3
steps per configuration and rank 0 saves the model and ``opt.state_dict()``; phase ``"load"`` loads that
file on every rank of another world size, trains 3 more steps and records the weights after each.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, Dict

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

GLOBAL_BATCH = 16
#: name -> (face, arguments)
CONFIGS: Dict[str, Any] = {
    "sso-kfac-mem": ("sso", dict(approx="kfac", curvature="fisher", grad_worker_fraction="mem_opt",
                                 inv_update_interval=2)),
    "sso-diag": ("sso", dict(approx="diag", curvature="fisher")),
    "vi-diag": ("vi", dict()),
    "vi-kfac": ("vi", dict(approx="kfac")),
}


def _build(face: str, model: nn.Module, args: Dict[str, Any]) -> Any:
    from torchsso2 import SecondOrderOptimizer, VIOptimizer

    if face == "sso":
        return SecondOrderOptimizer(model, lr=0.05, seed=0, **args)
    return VIOptimizer(model, dataset_size=64, lr=0.05, seed=0, **args)


def main(rank: int, world_size: int, init_file: str, out_dir: str, phase: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        for name, (face, args) in CONFIGS.items():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()
            ddp = DDP(model)
            opt = _build(face, ddp, args)

            def step(s: int) -> None:
                g = torch.Generator().manual_seed(s)
                x = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)
                y = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
                n = GLOBAL_BATCH // world_size
                xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]

                def closure() -> Any:
                    opt.zero_grad()
                    out = ddp(xs)
                    loss = F.cross_entropy(out, ys)
                    loss.backward()
                    return loss, out

                opt.step(closure)

            path = os.path.join(out_dir, f"{name}.pt")
            if phase == "save":
                for s in range(3):
                    step(s)
                if rank == 0:
                    torch.save(dict(model=model.state_dict(), opt=opt.state_dict()), path)
                dist.barrier()
                continue
            ckpt = torch.load(path, weights_only=False)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            rows = []
            for s in range(3, 6):
                step(s)
                rows.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            torch.save(torch.stack(rows), os.path.join(out_dir, f"{name}_weights{rank}.pt"))
    finally:
        dist.destroy_process_group()
