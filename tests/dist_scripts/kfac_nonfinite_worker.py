"""gloo rank for tests/test_kfac_reliability.py: a fault on one rank only, model in DDP.

Each rank trains two DDP models with KFACPreconditioner (MEM_OPT: one grad worker per layer,
so the preconditioned gradients are broadcast and a rank that skipped alone would hang its
peer): run "nan" sees, at step 2, a batch that is NaN on rank 1 only, or (``fail_eigh``) a
normal batch during which every decomposition on rank 0 raises LinalgError; run "clean" never
sees that step. Saves the parameters after every applied step and the skip counters.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, Dict, List, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import kfac_dist_common as common  # noqa: E402
from curvature.linalg import LinalgError  # noqa: E402
from curvature.linalg.torch_backend import TorchBackend  # noqa: E402

STEPS = 5
NAN_STEP = 2


class _FailingBackend(TorchBackend):
    """torch.linalg; every eigh raises LinalgError while ``fail`` is set."""

    fail = False

    def _eigh(self, a: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.fail:
            raise LinalgError("eigh did not converge (injected)")
        return super()._eigh(a)


def _train(rank: int, with_nan: bool, cfg: Dict[str, Any], fail_eigh: bool = False) -> Dict[str, Any]:
    from torchsso2.kfac import KFACPreconditioner

    model = DDP(common.build())
    backend = _FailingBackend()
    pre = KFACPreconditioner(model, linalg=backend, **{**common.BASE, **cfg})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows: List[torch.Tensor] = []
    for step in range(STEPS):
        if step == NAN_STEP:
            if not with_nan:
                continue
            x, y = common.shard(100, rank)
            if rank == 1 and not fail_eigh:
                x[0, 0, 0, 0] = float("nan")
            backend.fail = fail_eigh and rank == 0
        else:
            x, y = common.shard(step, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        backend.fail = False
        if pre.last_step_skipped:
            continue
        opt.step()
        rows.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return dict(params=torch.stack(rows), num_skipped=pre.num_skipped, steps=pre.steps)


def main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        from torchsso2.kfac import DistributedStrategy

        results = {}
        for name, cfg in (("mem_opt-eigen", dict(grad_worker_fraction=DistributedStrategy.MEM_OPT)),
                          ("comm_opt-inverse-step", dict(compute_method="inverse", update_factors_in_hook=False))):
            results[name] = {"nan": _train(rank, True, cfg), "clean": _train(rank, False, cfg)}
        mem_opt = dict(grad_worker_fraction=DistributedStrategy.MEM_OPT)
        results["mem_opt-eigh-fails-on-rank0"] = {"nan": _train(rank, True, mem_opt, fail_eigh=True),
                                                  "clean": _train(rank, False, mem_opt)}
        torch.save(results, os.path.join(out_dir, f"nonfinite_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _resume_run(rank: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """factor_update_steps=2, inv_update_steps=3: train 5 steps, checkpoint (each rank its own
    state_dict, and rank 0's), train 4 more; resume from each kind of checkpoint."""
    import io

    from torchsso2.kfac import KFACPreconditioner

    def steps(model: torch.nn.Module, pre: Any, rng: range) -> torch.Tensor:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rows = []
        for step in rng:
            opt.zero_grad()
            x, y = common.shard(step, rank)
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
            rows.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
        return torch.stack(rows)

    kw = {**common.BASE, **cfg, "factor_update_steps": 2, "inv_update_steps": 3}
    model = DDP(common.build())
    pre = KFACPreconditioner(model, **kw)
    steps(model, pre, range(5))
    own = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "kfac": pre.state_dict()}, own)
    objects: List[Any] = [own.getvalue()]
    dist.broadcast_object_list(objects, src=0)  # rank 0's checkpoint, as one file loaded by every rank
    straight = steps(model, pre, range(5, 9))
    out = {"straight": straight}
    for name, blob in (("own", own.getvalue()), ("rank0", objects[0])):
        ckpt = torch.load(io.BytesIO(blob))
        fresh = common.build()
        fresh.load_state_dict(ckpt["model"])
        model2 = DDP(fresh)
        pre2 = KFACPreconditioner(model2, **{**kw, "damping": 0.5})
        pre2.load_state_dict(ckpt["kfac"])
        out[name] = steps(model2, pre2, range(5, 9))
    return out


def resume_main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        from torchsso2.kfac import DistributedStrategy

        results = {name: _resume_run(rank, cfg) for name, cfg in (
            ("comm_opt-eigen", {}),
            ("mem_opt-eigen", dict(grad_worker_fraction=DistributedStrategy.MEM_OPT)),
            ("mem_opt-inverse", dict(grad_worker_fraction=DistributedStrategy.MEM_OPT, compute_method="inverse")))}
        torch.save(results, os.path.join(out_dir, f"resume_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
