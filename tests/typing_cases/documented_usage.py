"""Code the README and docs show as valid, for a type checker (tests/test_type_hints.py runs mypy on it;
it is never executed). Each line once gave a false error to users' mypy/pyright through py.typed."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import curvature
from torchsso2 import SecondOrderOptimizer, VIOptimizer, metrics
from torchsso2.kfac import ComputeMethod, KFACPreconditioner

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))

# README quick tour: the result API
c = curvature.compute(model, x, y, loss="cross_entropy", kind="fisher", approx="kfac")
dense: Tensor = c.dense()
factors = (c.blocks["0"].A, c.blocks["0"].G)
v = torch.randn(sum(p.numel() for p in model.parameters()))
product: Tensor = c @ v
print(product.norm(), torch.allclose(c @ v, c.dense() @ v), c.matvec(v).shape)
solved: Tensor = c.solve(v, damping=1e-3)
solved_t: Tensor = c.solve(v, damping=torch.tensor(1e-3))
parts: List[Tensor] = c.matvec([torch.ones_like(p) for p in model.parameters()])
# guide: a dict picks the shape per module (built elsewhere: Dict[str, str], Dict[type, str])
by_name: Dict[str, str] = {"0": "full", "2": "diag"}
by_type = {nn.Linear: "kfac"}
curvature.compute(model, x, y, loss="cross_entropy", approx=by_name)
curvature.compute(model, x, y, loss="cross_entropy", approx=by_type)

# VIOptimizer.predict is a tensor unless return_variance=True
vi = VIOptimizer(model, dataset_size=1500, lr=1e-2)
probs = vi.predict(x, num_samples=32)
print(probs.argmax(-1), probs.shape, metrics.nll(probs, y), metrics.ece(vi.predict(x), y))
regression = VIOptimizer(model, dataset_size=1500, loss="mse", noise_variance="learned")
mean, var = regression.predict(x, return_variance=True)
print(mean.shape, var.shape)

# step(closure=None) as torch.optim's signature
opt = SecondOrderOptimizer(model, lr=0.05)


def closure() -> Tuple[Tensor, Tensor]:
    opt.zero_grad()
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return loss, out


loss, out = opt.step(closure)
opt.step(closure=closure, targets=y)

# KFACPreconditioner with kfac_pytorch's argument forms (docs/kfac.md)
pre = KFACPreconditioner(model, kl_clip=lambda step: None, damping=torch.tensor(0.01),
                         compute_method=ComputeMethod.INVERSE, skip_layers=("^2$",),
                         grad_worker_fraction=0.5, factor_update_steps=lambda step: 10)
strategy = pre.assignment_strategy
print(pre.assignment, pre.allreduce_bucket_cap_mb, pre.allreduce_method, pre.colocate_factors,
      pre.compute_eigenvalue_outer_product, pre.compute_method, pre.distributed_strategy,
      pre.grad_worker_fraction, pre.grad_scaler, pre.factor_dtype, pre.inv_dtype, pre.skip_layers,
      pre.symmetry_aware, strategy)
