"""Adaptive K-FAC with ``curvature="empirical_fisher"``: the option sets only the K-FAC factors (the
direction Δ); the quadratic model that sets the step length keeps the exact GGN of the batch
(brute force, float64), not the empirical Fisher."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from torchsso2.optim import SecondOrderOptimizer
from optim_helpers import make_closure


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=g)
    return model, x, y


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


@pytest.mark.parametrize("seqfast", [True, False])
def test_adaptive_step_length_uses_the_ggn_with_empirical_fisher_factors(seqfast, monkeypatch):
    from torchsso2.optim import sequential_jvp
    if not seqfast:  # the dual-number path takes the same products
        monkeypatch.setattr(sequential_jvp, "supports", lambda *a, **k: False)
    model, x, y = _problem()
    lam = 0.05
    opt = SecondOrderOptimizer(model, approx="kfac", curvature="empirical_fisher", damping=lam, ema_decay=0.0,
                               use_adaptive_learning_rate=True, use_adaptive_momentum=True)
    assert opt.engine.kind.value == "empirical_fisher"
    theta = _flat(p.detach() for p in model.parameters()).clone()

    def logits(vec: torch.Tensor) -> torch.Tensor:
        ps, i = {}, 0
        for n, p in model.named_parameters():
            ps[n] = vec[i:i + p.numel()].view_as(p)
            i += p.numel()
        return torch.func.functional_call(model, ps, (x,))

    def loss_of(vec: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits(vec), y)

    d = torch.autograd.functional.jacobian(loss_of, theta)
    jac = torch.autograd.functional.jacobian(logits, theta)  # [N, C, P]
    p = torch.softmax(logits(theta), 1)
    h = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)  # [N, C, C]
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, h, jac) / x.shape[0]
    per_example = torch.stack([torch.autograd.functional.jacobian(
        lambda v, i=i: nn.functional.cross_entropy(logits(v)[i:i + 1], y[i:i + 1]), theta) for i in range(len(y))])
    emp = per_example.t() @ per_example / len(y)

    closure = make_closure(opt, model, x, y)

    opt.step(closure)  # the first step: only α, so the update u = αΔ with α = −Δᵀd / Δᵀ(G + λI)Δ
    u = _flat(p.detach() for p in model.parameters()) - theta
    eye = torch.eye(len(theta), dtype=torch.float64)
    quad = float(u @ (ggn + lam * eye) @ u)
    # α minimises ½α²Δᵀ(G+λI)Δ + αΔᵀd: uᵀ(G + λI)u = −uᵀd and M = −½ uᵀ(G + λI)u
    assert quad == pytest.approx(-float(u @ d), rel=1e-9)
    assert opt.adaptive.last["quad_model"] == pytest.approx(-0.5 * quad, rel=1e-9)
    # the empirical Fisher in the model would give another step length (the check above can fail)
    assert abs(float(u @ (emp + lam * eye) @ u) + float(u @ d)) > 1e-3 * abs(float(u @ d))
