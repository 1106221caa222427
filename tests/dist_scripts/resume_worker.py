"""Worker of tests/test_distributed_resume.py: a checkpoint saved on rank 0 and loaded on every rank.

``python resume_worker.py OUT_DIR`` under ``mpiexec -n 2``: for each configuration, 3 steps, rank 0's
state_dict (model and optimizer), fresh objects on every rank that load it, 3 more steps; and the
same 6 steps without the interruption. Each rank writes ``{config: (resumed, uninterrupted,
label generator state after the load)}`` to ``OUT_DIR/rank<r>.pt``; ``config + "-own"``: the same with
each rank loading its own state_dict (one file per rank).
"""
from __future__ import annotations

import io
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))  # tests/: optim_helpers

import torch  # noqa: E402
from torch import nn  # noqa: E402

from torchsso2 import SecondOrderOptimizer, VIOptimizer  # noqa: E402
from torchsso2.distributed import get_communicator  # noqa: E402
from optim_helpers import make_closure  # noqa: E402

CONFIGS = {
    "vi-kfac": ("vi", dict(dataset_size=100, seed=0, approx="kfac", curvature="fisher",
                           curv_update_interval=1, inv_update_interval=1)),
    "vi-diag": ("vi", dict(dataset_size=100, seed=0)),
    "vi-kfac-mem": ("vi", dict(dataset_size=100, seed=0, approx="kfac", curvature="fisher",
                               grad_worker_fraction="mem_opt", curv_update_interval=1, inv_update_interval=1)),
    "sso-mc": ("sso", dict(lr=0.1, seed=0)),
    "vi-kfac-mc": ("vi", dict(dataset_size=100, seed=0, approx="kfac", curv_update_interval=1, inv_update_interval=1)),
}


def main() -> None:
    comm = get_communicator()
    rank = comm.rank
    torch.set_num_threads(1)
    results = {}
    for name, (face, kw) in CONFIGS.items():
        def make():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
            opt = SecondOrderOptimizer(model, **kw) if face == "sso" else VIOptimizer(model, **kw)
            return model, opt

        def run(model, opt, start, stop):
            for step in range(start, stop):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
                x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
                opt.step(make_closure(opt, model, x, y))

        model, opt = make()
        run(model, opt, 0, 6)
        straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        for own in (False, True):
            model, opt = make()
            run(model, opt, 0, 3)
            buf = io.BytesIO()
            torch.save((model.state_dict(), opt.state_dict()), buf)  # every rank saves; rank 0's is loaded
            if own:  # each rank its own file
                msd, osd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
            else:
                blob = torch.tensor(list(buf.getvalue()), dtype=torch.uint8) if rank == 0 else None
                size = torch.tensor([0 if blob is None else blob.numel()], dtype=torch.float64)
                comm.allreduce([size], op="sum")
                data = blob.double() if blob is not None else torch.zeros(int(size.item()), dtype=torch.float64)
                comm.broadcast([data], src=0)
                msd, osd = torch.load(io.BytesIO(bytes(data.to(torch.uint8).tolist())), weights_only=True)
            model, opt = make()
            model.load_state_dict(msd)
            opt.load_state_dict(osd)
            labels = opt.generator.get_state().clone()
            run(model, opt, 3, 6)
            results[name + ("-own" if own else "")] = (
                torch.cat([p.detach().reshape(-1) for p in model.parameters()]), straight, labels)
    torch.save(results, os.path.join(sys.argv[1], f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
