"""Shared by the K-FAC distributed tests: the model, the shards, the configurations, the loop.

Every rank trains the same tiny float64 ConvNet on its own shard for ``STEPS`` steps under
each configuration and records the preconditioned gradients (after ``preconditioner.step()``)
and the bytes its communicator sent. The test compares them across ranks, strategies,
backends and with one process that feeds the ``W`` shards as ``W`` accumulated micro-batches.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from torchsso2.kfac import DistributedStrategy, KFACPreconditioner  # noqa: E402

STEPS = 3
SHARD = 4
DT = torch.float64
BASE = dict(damping=0.01, lr=0.1, kl_clip=0.01, factor_decay=0.9, inv_dtype=DT)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3, stride=2, bias=False)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.conv2(torch.relu(self.conv1(x)))).flatten(1))


def build() -> nn.Module:
    torch.manual_seed(0)
    return ConvNet().to(DT)


def shard(step: int, rank: int) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(SHARD, 2, 5, 5, generator=g, dtype=DT), torch.randint(0, 3, (SHARD,), generator=g)


def configs(world_size: int) -> Dict[str, Dict[str, Any]]:
    """Name -> preconditioner arguments (besides BASE)."""
    C, M, H = DistributedStrategy.COMM_OPT, DistributedStrategy.MEM_OPT, DistributedStrategy.HYBRID_OPT
    if world_size >= 4:
        return {
            "comm_opt-eigen": dict(grad_worker_fraction=C),
            "mem_opt-inverse-sym": dict(grad_worker_fraction=M, compute_method="inverse", symmetry_aware=True),
            "hybrid-eigen-sym": dict(grad_worker_fraction=H, symmetry_aware=True),
            "hybrid-inverse-spread": dict(grad_worker_fraction=H, compute_method="inverse", colocate_factors=False),
        }
    out: Dict[str, Dict[str, Any]] = {}
    for sname, strat in (("comm_opt", C), ("mem_opt", M), ("hybrid", H)):
        for method in ("eigen", "inverse"):
            for sym in (False, True):
                out[f"{sname}-{method}{'-sym' if sym else ''}"] = dict(
                    grad_worker_fraction=strat, compute_method=method, symmetry_aware=sym)
    out["comm_opt-eigen-spread-nobucket"] = dict(grad_worker_fraction=C, colocate_factors=False,
                                                compute_eigenvalue_outer_product=False, allreduce_bucket_cap_mb=0)
    out["mem_opt-eigen-noprediv-tinybucket-memory"] = dict(
        grad_worker_fraction=M, compute_eigenvalue_outer_product=False, allreduce_bucket_cap_mb=1e-4,
        assignment_strategy="memory")
    out["comm_opt-cadence-step-update"] = dict(grad_worker_fraction=0.5 if world_size > 1 else 1.0,
                                               inv_update_steps=2, update_factors_in_hook=False,
                                               damping=lambda s: 0.01 * (s + 1))
    return out


def flat_grads(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def train(model: nn.Module, pre: KFACPreconditioner, micro_batches: Callable[[int], List[Tuple[Tensor, Tensor]]],
          average: Optional[Callable[[List[Tensor]], None]] = None) -> Tensor:
    """``STEPS`` steps; returns the preconditioned gradients ``[STEPS, P]``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = []
    for step in range(STEPS):
        opt.zero_grad()
        batches = micro_batches(step)
        for x, y in batches:  # the mean loss of each micro-batch, gradients summed
            F.cross_entropy(model(x), y).backward()
        params = [p for p in model.parameters()]
        for p in params:
            p.grad /= len(batches)
        if average is not None:
            average([p.grad for p in params])
        pre.step()
        rows.append(flat_grads(model))
        opt.step()
    return torch.stack(rows)


def run_rank(comm: Any, wrap: Callable[[nn.Module], nn.Module],
             average: Optional[Callable[[List[Tensor]], None]] = None) -> Dict[str, Any]:
    """All configurations on this rank.

    ``wrap`` makes the DDP model (or returns the model as it is); ``average`` (when there is
    no DDP) averages the gradients over ranks — its bytes are not counted in ``bytes``.
    """
    results: Dict[str, Any] = {}
    for name, cfg in configs(comm.world_size).items():
        model = build()
        wrapped = wrap(model)
        grad_bytes = [0]

        def counted_average(grads: List[Tensor]) -> None:
            before = comm.bytes_sent
            average(grads)  # type: ignore[misc]
            grad_bytes[0] += comm.bytes_sent - before

        comm.reset_counters()
        pre = KFACPreconditioner(wrapped, communicator=comm, **{**BASE, **cfg})
        grads = train(wrapped, pre, lambda s: [shard(s, comm.rank)], counted_average if average else None)
        results[name] = dict(grads=grads, bytes=comm.bytes_sent - grad_bytes[0],
                             grad_workers=pre.assignment.grad_workers_per_layer,
                             sizes={n.replace("module.", "", 1): dict(l.sizes) for n, l in pre.layers.items()})
    results["refusals"] = refusals(pre)
    return results


def refusals(pre: KFACPreconditioner) -> List[str]:
    """The errors of pickling and deep-copying a preconditioner that spans several processes."""
    import copy
    import io
    said = []
    for attempt in (lambda: torch.save(pre, io.BytesIO()), lambda: copy.deepcopy(pre)):
        try:
            attempt()
            said.append("")
        except TypeError as err:
            said.append(str(err))
    return said


def single_process(world_size: int, name: str) -> Tensor:
    """One process feeding the ``world_size`` shards as accumulated micro-batches."""
    from torchsso2.distributed import LocalCommunicator

    cfg = {**BASE, **configs(world_size)[name]}
    model = build()
    pre = KFACPreconditioner(model, communicator=LocalCommunicator(), accumulation_steps=world_size, **cfg)
    return train(model, pre, lambda s: [shard(s, r) for r in range(world_size)])
