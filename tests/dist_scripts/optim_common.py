"""Shared by tests/test_distributed_optim.py and its workers: models, shards, configurations, loop.

Every rank trains a tiny float64 MLP for ``STEPS`` steps under each configuration of
:func:`configs` (optimizer × shape × KAISA placement, plus MC-sample parallel VI runs) on its
shard of a fixed global batch, and records the flat parameters after every step and the
bytes its communicator sent. The test compares them with ONE process (``LocalCommunicator``)
on the whole batch — with ``num_mc_samples = mc_parallel · m`` for the MC-parallel runs.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, Optional, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from torchsso2.optim import SecondOrderOptimizer, VIOptimizer  # noqa: E402

STEPS = 3
BATCH = 24  # the global batch: D data ranks read BATCH / D examples each (D in 1, 2, 4)
DT = torch.float64
SHAPES = ("full", "diag", "kfac")

SO_BASE = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, curvature="fisher", damping=1e-2, ema_decay=0.9,
               kl_clip=1e-2, seed=3)
#: curvature and decompositions at every step for every approx (VIOptimizer's kfac default is 10/10;
#: the cost model of tests/test_distributed_optim.py counts an estimate and a decomposition per step)
VI_BASE = dict(dataset_size=240, lr=0.1, momentum=0.9, curvature="fisher", prior_precision=1.0,
               init_precision=100.0, ema_decay=0.9, loss="mse", seed=5, curv_update_interval=1, inv_update_interval=1)


def build(face: str) -> nn.Module:
    """3 -> 4 -> out MLP; classification (3 classes) for SO, regression (1 output) for VI.

    VI uses one output and more examples than parameters per block, so that no damped block
    has a degenerate eigenspace (weight samples use eigenvectors, unique only then).
    """
    torch.manual_seed(0)
    out = 3 if face == "so" else 1
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, out)).to(DT)


def whole_batch(step: int, face: str) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 3, generator=g, dtype=DT)
    y = torch.randint(0, 3, (BATCH,), generator=g) if face == "so" else torch.randn(BATCH, 1, generator=g, dtype=DT)
    return x, y


def shard(step: int, face: str, data_rank: int, data_size: int) -> Tuple[Tensor, Tensor]:
    x, y = whole_batch(step, face)
    n = BATCH // data_size
    return x[data_rank * n:(data_rank + 1) * n], y[data_rank * n:(data_rank + 1) * n]


def configs(world_size: int) -> Dict[str, Dict[str, Any]]:
    """Name -> ``dict(face=..., mc_parallel=..., **optimizer kwargs)``."""
    out: Dict[str, Dict[str, Any]] = {}
    if world_size >= 4:
        out["so-kfac-comm_opt"] = dict(face="so", approx="kfac", grad_worker_fraction="comm_opt")
        out["so-full-hybrid-memory"] = dict(face="so", approx="full", grad_worker_fraction="hybrid_opt",
                                            assignment_strategy="memory")
        out["vi-diag-mem_opt"] = dict(face="vi", approx="diag", grad_worker_fraction="mem_opt")
        out["vi-kfac-mc2-hybrid"] = dict(face="vi", approx="kfac", mc_parallel=2, num_mc_samples=2,
                                         grad_worker_fraction="hybrid_opt")
        out["vi-full-mc2"] = dict(face="vi", approx="full", mc_parallel=2)
        return out
    for face in ("so", "vi"):
        for approx in SHAPES:
            for frac in ("comm_opt", "mem_opt"):
                out[f"{face}-{approx}-{frac}"] = dict(face=face, approx=approx, grad_worker_fraction=frac)
    out["so-kfac-lm-memory"] = dict(face="so", approx="kfac", adaptive_damping=True, damping_adaptation_interval=2,
                                    assignment_strategy="memory")
    out["so-diag-empirical"] = dict(face="so", approx="diag", curvature="empirical_fisher", grad_worker_fraction="mem_opt")
    out["so-kfac-inverse-mem_opt"] = dict(face="so", approx="kfac", kfac_method="inverse", grad_worker_fraction="mem_opt")
    out["vi-kfac-2samples-mem_opt"] = dict(face="vi", approx="kfac", num_mc_samples=2, grad_worker_fraction="mem_opt")
    if world_size == 2:
        for approx in SHAPES:
            out[f"vi-{approx}-mc2"] = dict(face="vi", approx=approx, mc_parallel=2)
        out["vi-full-mc2-mem_opt"] = dict(face="vi", approx="full", mc_parallel=2, grad_worker_fraction="mem_opt")
    return out


def make(cfg: Dict[str, Any], model: nn.Module, comm: Any, single: bool = False):
    """The optimizer of ``cfg``; ``single``: the one-process reference (all samples in one process)."""
    kw = {k: v for k, v in cfg.items() if k not in ("face",)}
    if single and cfg["face"] == "vi":
        kw["num_mc_samples"] = kw.get("num_mc_samples", 1) * kw.pop("mc_parallel", 1)
    if single:
        kw.pop("grad_worker_fraction", None)
        kw.pop("assignment_strategy", None)
    if cfg["face"] == "so":
        return SecondOrderOptimizer(model, communicator=comm, **{**SO_BASE, **kw})
    return VIOptimizer(model, communicator=comm, **{**VI_BASE, **kw})


def closure_for(opt: Any, model: nn.Module, face: str, x: Tensor, y: Tensor,
                fail: Optional[Tuple[int, int]] = None, rank: int = 0, step: int = 0):
    def closure():
        if fail is not None and (rank, step) == fail:
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y) if face == "so" else 0.5 * (out - y).pow(2).sum(-1).mean()
        loss.backward()
        return loss, out
    return closure


def flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train(cfg: Dict[str, Any], comm: Any, single: bool = False, fail: Optional[Tuple[int, int]] = None
          ) -> Dict[str, Any]:
    """``STEPS`` steps; returns ``params [STEPS, P]``, ``bytes`` sent and the grad workers per block."""
    face = cfg["face"]
    model = build(face)
    opt = make(cfg, model, comm, single)
    comm.reset_counters()  # count the steps only, not the start-up broadcast
    rows = []
    dampings = [getattr(opt, "damping", None)]  # before and after each step (SecondOrderOptimizer's LM rule)
    for step in range(STEPS):
        if single:
            x, y = whole_batch(step, face)
        else:
            d = getattr(opt, "data_parallel_size", comm.world_size)
            r = getattr(opt, "data_parallel_rank", comm.rank)
            x, y = shard(step, face, r, d)
        opt.step(closure_for(opt, model, face, x, y, fail, comm.rank, step))
        rows.append(flat(model))
        dampings.append(getattr(opt, "damping", None))
    wa = opt.placement.assignment
    return dict(params=torch.stack(rows), bytes=comm.bytes_sent, skipped=opt.num_skipped, dampings=dampings,
                grad_workers=None if wa is None else wa.grad_workers_per_layer,
                numel={n: lay.numel for n, lay in opt.engine.layouts.items()},
                stats={n: [tuple(t.shape) for t in b.tensors()] for n, b in opt.running.blocks.items()})


def run_rank(comm: Any) -> Dict[str, Any]:
    """Every configuration of this world size on this rank."""
    return {name: train(cfg, comm) for name, cfg in configs(comm.world_size).items()}


def failing_run(comm: Any) -> Dict[str, Any]:
    """Rank 1 raises inside its closure at step 1; returns what rank 0 saw (error and seconds)."""
    cfg = dict(face="vi", approx="kfac", grad_worker_fraction="comm_opt")
    start = time.monotonic()
    try:
        train(cfg, comm, fail=(1, 1))
    except Exception as err:  # rank 0: the collective fails because its peer is gone
        if comm.rank == 1:
            raise
        return dict(error=f"{type(err).__name__}: {err}", seconds=time.monotonic() - start)
    return dict(error=None, seconds=time.monotonic() - start)
