"""adaptive_damping's answer to a failed decomposition (an indefinite Hessian's diagonal) on one process or on
the ranks of ``mpiexec -n 2`` (each on its half of every batch, the grad workers of ``grad_worker_fraction``):
``python shortfall_worker.py OUT`` writes ``OUT/rank<r>.pt`` with the damping after each step and the counts."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer
from torchsso2.distributed import get_communicator


def _shard_step(opt: SecondOrderOptimizer, model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int,
                world: int) -> None:
    """One step on this rank's equal share of the batch ``(x, y)``, the targets given."""
    n = x.shape[0] // world
    xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]

    def closure():
        opt.zero_grad()
        out = model(xs)
        loss = F.cross_entropy(out, ys)
        loss.backward()
        return loss, out
    opt.step(closure, targets=ys)


def train(comm: Optional[Any], fraction: float = 1.0) -> Dict[str, Any]:
    """12 steps of a tanh MLP (64-32-10, float64) at damping 1e-3, whose first diagonal decomposition fails."""
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).double()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 10, generator=g, dtype=torch.float64)
    kw: Dict[str, Any] = dict(approx="diag", curvature="hessian", damping=1e-3, adaptive_damping=True, ema_decay=0.0,
                              use_adaptive_learning_rate=True, use_adaptive_momentum=True)
    if comm is not None:
        kw.update(communicator=comm, grad_worker_fraction=fraction)
    opt = SecondOrderOptimizer(model, **kw)
    dampings = []
    for _ in range(12):
        x = torch.randn(64, 64, generator=g, dtype=torch.float64)
        _shard_step(opt, model, x, (x @ w).argmax(1), rank, world)
        dampings.append(opt.damping)
    return {"damping": torch.tensor(dampings, dtype=torch.float64), "skipped": opt.num_skipped,
            "steps": opt.num_steps}


def two_short_blocks(comm: Optional[Any], fraction: float = 1.0) -> float:
    """The damping after one failed decomposition of four diagonal blocks (damping 1) of which the first two
    fall short by 0.1 and by 4 (one rank decomposes both at ``grad_worker_fraction=0.5``): 1 + 2·4 = 9."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(),
                          nn.Linear(5, 3)).double()
    kw: Dict[str, Any] = dict(approx="diag", curvature="hessian", damping=1.0, adaptive_damping=True, lr=0.1,
                              curv_update_interval=1000, inv_update_interval=1000)
    if comm is not None:
        kw.update(communicator=comm, grad_worker_fraction=fraction)
    opt = SecondOrderOptimizer(model, **kw)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    _shard_step(opt, model, x, y, 0, 1)  # the whole batch on every rank
    opt.running.blocks["0"].diagonal.fill_(-1.1)
    opt.running.blocks["2"].diagonal.fill_(-5.0)
    assert not opt._decompose(opt.damping)
    return opt.damping


def kfac_lm(comm: Optional[Any], fraction: float = 1.0, method: str = "eigen", layers: int = 2) -> Dict[str, Any]:
    """K-FAC (Fisher, float64) with the LM rule at every step and a decomposition every 7 steps: each damping
    change re-damps eigen decompositions in place, with several processes too (each rank those it holds, one
    all-reduce reached by every rank, one holding none included: ``layers=1`` at fraction 0.5), so the ranks
    decompose as often as one process and follow its damping; ``inverse`` ones are redone at the next step."""
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    torch.manual_seed(0)
    model = (nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)) if layers == 2 else
             nn.Sequential(nn.Linear(6, 3))).double()
    kw: Dict[str, Any] = dict(approx="kfac", curvature="fisher", damping=0.1, adaptive_damping=True, lr=0.05,
                              kl_clip=None, damping_adaptation_interval=1, inv_update_interval=7, kfac_method=method)
    if comm is not None:
        kw.update(communicator=comm, grad_worker_fraction=fraction)
    opt = SecondOrderOptimizer(model, **kw)
    decompositions = []
    original = opt._decompose

    def counted(*args: Any, **kwargs: Any) -> bool:
        decompositions.append(opt.num_steps)
        return original(*args, **kwargs)
    opt._decompose = counted  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(0)
    dampings = []
    for _ in range(14):
        x, y = torch.randn(32, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (32,), generator=g)
        _shard_step(opt, model, x, y, rank, world)
        dampings.append(opt.damping)
    return {"damping": torch.tensor(dampings, dtype=torch.float64), "decomposed_at": decompositions,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    comm = get_communicator("auto")
    results: Dict[Any, Any] = {f: train(comm, f) for f in (1.0, 0.5)}
    results["two_short_blocks"] = {f: two_short_blocks(comm, f) for f in (1.0, 0.5)}
    results["kfac_lm"] = {(f, m, n): kfac_lm(comm, f, m, n) for f in (1.0, 0.5) for m in ("eigen", "inverse")
                          for n in (1, 2)}
    torch.save(results, out / f"rank{comm.rank}.pt")
