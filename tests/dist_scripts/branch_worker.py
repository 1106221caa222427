"""Ranks whose batches take different branches of the model (multi-task heads routed per rank).

``python branch_worker.py FACE MODE`` under ``mpiexec -n 2`` or ``torchrun --nproc_per_node 2``:
rank 0's shard goes through head ``a``, rank 1's through head ``b`` (MODE "split"), or through both
(MODE "both"); the heads are uncovered (``skip_modules``). After 3 steps rank 0 compares every
parameter with ONE process running both shards in one closure (each loss / 2) and prints
``MAXDIFF <value>``; every rank prints ``REPLICAS <max difference to rank 0>``.
"""
from __future__ import annotations

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from torchsso2.distributed import LocalCommunicator, get_communicator, shutdown  # noqa: E402
from torchsso2.optim import SecondOrderOptimizer, VIOptimizer  # noqa: E402

FACE, MODE = sys.argv[1], sys.argv[2]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 5)
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if task == 1 and MODE == "both":
            return self.a(h) + self.b(h)
        return (self.a if task == 0 else self.b)(h)


def run(comm, rank: int, single: bool) -> nn.Module:
    torch.manual_seed(0)
    model = Net().double()
    if FACE == "vi":
        opt = VIOptimizer(model, communicator=comm, dataset_size=160, lr=0.1, approx="kfac", curvature="fisher",
                          seed=5, curv_update_interval=1, inv_update_interval=1, skip_modules=["a", "b"])
    else:
        opt = SecondOrderOptimizer(model, communicator=comm, lr=0.1, momentum=0.9, approx="kfac", curvature="fisher",
                                   damping=1e-2, seed=3, skip_modules=["a", "b"])
    for step in range(3):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(16, 4, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=g)

        def closure():
            opt.zero_grad()
            if single:
                total = 0.0
                for task, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
                    out = model(xs, task)
                    loss = F.cross_entropy(out, ys) / 2
                    loss.backward()
                    total = total + loss.detach()
                return total, out
            out = model(x.chunk(2)[rank], rank)
            loss = F.cross_entropy(out, y.chunk(2)[rank])
            loss.backward()
            return loss, out
        opt.step(closure)
    return model


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


comm = get_communicator(timeout=60)
model = run(comm, comm.rank, single=False)
box = flat(model).clone()
comm.broadcast([box], src=0)
print(f"REPLICAS {(flat(model) - box).abs().max().item():.3e}", flush=True)
if comm.rank == 0:
    print(f"MAXDIFF {(flat(model) - flat(run(LocalCommunicator(), 0, single=True))).abs().max().item():.3e}", flush=True)
shutdown()
