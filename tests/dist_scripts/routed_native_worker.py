"""Covered modules that some ranks do not call (a mixture of experts routed per example), in
SecondOrderOptimizer / VIOptimizer with captured curvature.

``python routed_native_worker.py FACE APPROX KIND ROUTING [ddp]`` under ``mpiexec -n 2`` or ``torchrun
--nproc_per_node 2``. Each example goes through expert ``e0`` or ``e1`` by the sign of its first feature
(a fixed gate). ROUTING "split": rank 0's shard goes through ``e0`` only and rank 1's through ``e1`` only;
"mixed": rank 0's through ``e0`` only, rank 1's half and half; "micro": each rank's closure runs two
micro-batches, rank 0's through ``e0`` then ``e1``, rank 1's through ``e1`` then ``e0`` (so the ranks meet
the experts in other orders); every third step no example goes through ``e1`` on any rank. After 4 steps rank 0 compares every parameter (and the running curvature) with ONE
process running the whole batch in one forward, and prints ``MAXDIFF <value>``; every rank prints
``REPLICAS <max difference to rank 0>``. With ``ddp`` the model is wrapped in DistributedDataParallel;
with ``adaptive`` SecondOrderOptimizer adapts its learning rate and momentum.
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

FACE, APPROX, KIND, ROUTING = sys.argv[1:5]
DDP, ADAPTIVE = "ddp" in sys.argv[5:], "adaptive" in sys.argv[5:]


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 5)
        self.e0 = nn.Linear(5, 3)
        self.e1 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = h.new_zeros(x.shape[0], 3)
        for expert, rows in ((self.e0, (x[:, 0] > 0).nonzero().squeeze(1)),
                             (self.e1, (x[:, 0] <= 0).nonzero().squeeze(1))):
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]))
        return out


def batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 4, generator=g, dtype=torch.float64)
    sign = torch.ones(16, dtype=torch.float64)
    if step % 3 != 2 and ROUTING == "micro":  # each rank's two micro-batches: e0 then e1 on rank 0, e1 then e0 on 1
        sign[4:12] = -1.0
    elif step % 3 != 2:  # rank 1's shard (rows 8..15): e1 only, or half and half
        sign[8:] = -1.0 if ROUTING == "split" else torch.tensor([1.0, -1.0] * 4, dtype=torch.float64)
    x[:, 0] = x[:, 0].abs().add(0.1) * sign
    return x, torch.randint(0, 3, (16,), generator=g)


def run(comm, rank: int, single: bool):
    torch.manual_seed(0)
    model = Routed().double()
    net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if DDP and not single else model
    common = dict(communicator=comm, lr=0.1, approx=APPROX, curvature=KIND, curv_update_interval=1,
                  inv_update_interval=1)
    if FACE == "vi":
        opt = VIOptimizer(net, dataset_size=160, seed=5, **common)
    else:
        adaptive = dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True) if ADAPTIVE else {}
        opt = SecondOrderOptimizer(net, momentum=0.9, damping=1.0 if KIND == "hessian" else 1e-2, seed=3, **adaptive,
                                   **common)
    for step in range(4):
        x, y = batch(step)
        if not single:
            x, y = x.chunk(2)[rank], y.chunk(2)[rank]

        def closure():
            opt.zero_grad()
            parts = zip(x.chunk(2), y.chunk(2)) if ROUTING == "micro" and not single else [(x, y)]
            for xs, ys in parts:  # "micro": two micro-batches (gradient accumulation)
                out = net(xs)
                loss = F.cross_entropy(out, ys) * len(ys) / len(y)
                loss.backward()
            return loss, out
        opt.step(closure, targets=y if KIND in ("hessian", "empirical_fisher") else None)
    stats = [t.detach().reshape(-1) for name in sorted(opt.running.blocks) for t in opt.running.blocks[name].tensors()]
    return model, torch.cat(stats)


def flat(model: nn.Module, stats: torch.Tensor) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()] + [stats])


comm = get_communicator(timeout=60)
mine = flat(*run(comm, comm.rank, single=False))
box = mine.clone()
comm.broadcast([box], src=0)
print(f"REPLICAS {(mine - box).abs().max().item():.3e}", flush=True)
if comm.rank == 0:
    print(f"MAXDIFF {(mine - flat(*run(LocalCommunicator(), 0, single=True))).abs().max().item():.3e}", flush=True)
shutdown()
