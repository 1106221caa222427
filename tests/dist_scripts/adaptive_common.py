"""Adaptive lr/momentum over several processes (tests/test_adaptive_distributed.py and its MPI worker).

Every rank trains optim_common's float64 MLP (3 -> 4 -> 3) on its shard of optim_common's fixed
global batches under each configuration of :data:`CONFIGS`; the test compares the parameters
after every step, the solved coefficients and the LM damping with ONE process on the whole batch.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402

import optim_common as common  # noqa: E402
from torchsso2.optim import SecondOrderOptimizer  # noqa: E402

STEPS = 5
BASE = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, curvature="fisher", damping=1e-2, ema_decay=0.9, seed=3,
            use_adaptive_learning_rate=True, use_adaptive_momentum=True)
#: name -> optimizer keywords over BASE
CONFIGS: Dict[str, Dict[str, Any]] = {
    "kfac-lm": dict(approx="kfac", adaptive_damping=True, damping_adaptation_interval=2),
    "full-lr-mem_opt": dict(approx="full", use_adaptive_momentum=False, grad_worker_fraction="mem_opt"),
    "diag-hessian": dict(approx="diag", curvature="hessian", damping=0.5, adaptive_damping=True, damping_adaptation_interval=1),
    "kfac-intervals": dict(approx="kfac", curv_update_interval=2, inv_update_interval=3),
}


def train(name: str, comm: Any, single: bool) -> Dict[str, Any]:
    """``STEPS`` steps of configuration ``name``; ``single``: one process on the whole batch."""
    model = common.build("so")
    kw = dict(BASE, **CONFIGS[name])
    if single:
        kw.pop("grad_worker_fraction", None)
    opt = SecondOrderOptimizer(model, communicator=comm, **kw)
    rows, coefficients, dampings = [], [], []
    for step in range(STEPS):
        x, y = common.whole_batch(step, "so") if single else common.shard(step, "so", comm.rank, comm.world_size)
        opt.step(common.closure_for(opt, model, "so", x, y), targets=y)
        rows.append(common.flat(model))
        last = opt.adaptive.last
        coefficients.append([last["learning_rate"], last["momentum"], last["quad_model"]])
        dampings.append(opt.damping)
    return dict(params=torch.stack(rows), coefficients=torch.tensor(coefficients, dtype=torch.float64),
                damping=torch.tensor(dampings, dtype=torch.float64), skipped=opt.num_skipped)


def run_rank(comm: Any) -> Dict[str, Any]:
    return {name: train(name, comm, single=False) for name in CONFIGS}
