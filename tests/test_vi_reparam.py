"""VIOptimizer(curvature="reparam"): IVON's diagonal curvature ĥ = g ⊙ ε/σ² from the step's own
backward (issue 27, "curvature from the same backward").

* two steps against the estimator's formula and IVON's positivity-preserving EMA, by hand
  (gradients by plain autograd at the recorded weight samples);
* the estimator's expectation against the exact diagonal GGN (Monte Carlo, a 5-standard-error
  tolerance from the estimator's exact variance on a linear model);
* the EMA stays positive for any sign of ĥ; misuse is refused.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from torch import Tensor, nn

from optim_helpers import batch, grad_vec, make_closure, param_vec, reference_curvature, set_params, tiny_mlp
from torchsso2 import VIOptimizer
from torchsso2.optim.reparam import reparam_diagonal, reparam_ema_

N_DATA = 100


def _ema(c: Tensor, f: Tensor, beta: float, s: float) -> Tensor:
    return beta * c + (1 - beta) * f + 0.5 * (1 - beta) ** 2 * (c - f) ** 2 / (c + s)


def test_two_steps_equal_the_formula():
    """Step 1 samples θ1 = μ0 + ε1 with precision p0 = (N·h + τδ + d)/τ, so ĥ1 = g(θ1) ⊙ ε1 ⊙ p0;
    C1 = IVON-EMA(h, ĥ1); μ1 = μ0 − lr·P1⁻¹(N·g(θ1) + τδ·μ0), P1 = N·C1 + τδ + d. Step 2 samples
    with σ² = τ/P1: ĥ2 = g(θ2) ⊙ ε2 ⊙ P1/τ, C2 = IVON-EMA(C1, ĥ2), m2 = mom·m1 + g(θ2) + τδ/N·μ1,
    μ2 = μ1 − lr·N·P2⁻¹m2."""
    model = tiny_mlp()
    (x1, y1), (x2, y2) = batch(seed=1), batch(seed=2)
    lr, delta, tau, damp, mom, beta, h = 0.05, 2.0, 0.5, 0.3, 0.9, 0.9, 0.4
    shift = tau * delta + damp
    opt = VIOptimizer(model, dataset_size=N_DATA, lr=lr, curvature="reparam", approx="diag", prior_precision=delta,
                      kl_weighting=tau, damping=damp, momentum=mom, ema_decay=beta, curvature_init=h,
                      kl_clip=None, seed=7)
    seen: List[Dict[str, Tensor]] = []
    mu0 = param_vec(model)
    opt.step(make_closure(opt, model, x1, y1, record=seen))
    mu1 = param_vec(model)
    s1 = set_params(tiny_mlp(), seen[0])
    eps1, g1 = param_vec(s1) - mu0, grad_vec(s1, x1, y1)
    assert eps1.abs().max() > 1e-3
    p0 = (N_DATA * h + shift) / tau
    c1 = _ema(torch.full_like(mu0, h), g1 * eps1 * p0, beta, shift / N_DATA)
    big1 = N_DATA * c1 + shift
    m1 = g1 + tau * delta / N_DATA * mu0
    assert torch.allclose(mu1, mu0 - lr * N_DATA * m1 / big1, rtol=1e-9, atol=1e-12)
    assert torch.allclose(torch.cat([b.diagonal for b in opt.running.blocks.values()]), c1, rtol=1e-10, atol=1e-12)

    opt.step(make_closure(opt, model, x2, y2, record=seen))
    s2 = set_params(tiny_mlp(), seen[1])
    eps2, g2 = param_vec(s2) - mu1, grad_vec(s2, x2, y2)
    c2 = _ema(c1, g2 * eps2 * big1 / tau, beta, shift / N_DATA)
    m2 = mom * m1 + g2 + tau * delta / N_DATA * mu1
    assert torch.allclose(param_vec(model), mu1 - lr * N_DATA * m2 / (N_DATA * c2 + shift), rtol=1e-9, atol=1e-12)
    assert opt.num_skipped == 0


def test_several_samples_average_their_estimates():
    """num_mc_samples=3: the step's ĥ is the mean of the samples' g(θ_s) ⊙ ε_s ⊙ p0 (a sum was 3–5x the
    curvature and no single-process test saw it), and the mean moves by the mean gradient."""
    model = tiny_mlp()
    x1, y1 = batch(seed=1)
    lr, delta, tau, damp, beta, h, samples = 0.05, 2.0, 0.5, 0.3, 0.9, 0.4, 3
    shift = tau * delta + damp
    opt = VIOptimizer(model, dataset_size=N_DATA, lr=lr, curvature="reparam", approx="diag", prior_precision=delta,
                      kl_weighting=tau, damping=damp, momentum=0.0, ema_decay=beta, curvature_init=h,
                      kl_clip=None, seed=7, num_mc_samples=samples)
    seen: List[Dict[str, Tensor]] = []
    mu0 = param_vec(model)
    opt.step(make_closure(opt, model, x1, y1, record=seen))
    assert len(seen) == samples
    p0 = (N_DATA * h + shift) / tau
    hats, grads = [], []
    for sample in seen:
        s = set_params(tiny_mlp(), sample)
        eps, g = param_vec(s) - mu0, grad_vec(s, x1, y1)
        hats.append(g * eps * p0)
        grads.append(g)
    c1 = _ema(torch.full_like(mu0, h), torch.stack(hats).mean(0), beta, shift / N_DATA)
    assert torch.allclose(torch.cat([b.diagonal for b in opt.running.blocks.values()]), c1, rtol=1e-10, atol=1e-12)
    m1 = torch.stack(grads).mean(0) + tau * delta / N_DATA * mu0
    assert torch.allclose(param_vec(model), mu0 - lr * N_DATA * m1 / (N_DATA * c1 + shift), rtol=1e-9, atol=1e-12)


def test_expectation_is_the_exact_diagonal_ggn():
    """Linear least squares ``ℓ(θ) = ½·mean_n (xₙᵀθ − yₙ)²``: Hessian = GGN = H = XᵀX/n, constant,
    and ``g(μ + ε) = a + Hε`` (``a = g(μ)``). So ``ĥᵢ = aᵢεᵢ/σᵢ² + Σⱼ Hᵢⱼ εⱼεᵢ/σᵢ²`` has mean ``Hᵢᵢ``
    and variance ``aᵢ²/σᵢ² + Σ_{j≠i} Hᵢⱼ²σⱼ²/σᵢ² + 2Hᵢᵢ²`` exactly. Over K samples the mean of ĥ
    must be within 5 standard errors of the exact GGN diagonal (from ``curvature.compute``), each
    coordinate (a 5σ bound: a false failure has probability < 1e-5 over the 6 coordinates)."""
    gen = torch.Generator().manual_seed(0)
    n, d, k = 50, 6, 5000
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * torch.linspace(0.5, 2.0, d, dtype=torch.float64)
    y = torch.randn(n, 1, generator=gen, dtype=torch.float64)
    model = nn.Linear(d, 1, bias=False).double()
    ggn = next(iter(reference_curvature(model, x, y, loss="mse", kind="fisher", approx="diag").blocks.values())).diagonal
    hess = x.t() @ x / n
    assert torch.allclose(ggn, hess.diagonal(), rtol=1e-12)  # the loss helper's scale: ½·mean squared error
    mu = model.weight.detach().clone()
    sigma2 = torch.linspace(0.05, 0.5, d, dtype=torch.float64).reshape(1, d)
    total = torch.zeros(1, d, dtype=torch.float64)
    for _ in range(k):
        eps = torch.randn(1, d, generator=gen, dtype=torch.float64) * sigma2.sqrt()
        with torch.no_grad():
            model.weight.copy_(mu + eps)
        model.zero_grad()
        (0.5 * (model(x) - y).pow(2).sum(1).mean()).backward()
        total += reparam_diagonal([model.weight.grad], [eps], [1.0 / sigma2])[0]
    with torch.no_grad():
        model.weight.copy_(mu)
    a = (hess @ mu.reshape(-1, 1) - x.t() @ y / n).reshape(-1)
    s2 = sigma2.reshape(-1)
    var = a ** 2 / s2 + ((hess ** 2) @ s2 - hess.diagonal() ** 2 * s2) / s2 + 2 * hess.diagonal() ** 2
    err = (total.reshape(-1) / k - ggn).abs()
    assert (err < 5 * (var / k).sqrt()).all(), (err, (var / k).sqrt())


def test_ema_stays_positive_for_negative_estimates():
    """IVON's update: C + s > 0 after any ĥ (here ĥ far below −s), and it equals its formula."""
    c = torch.tensor([0.5, 1e-3, 2.0], dtype=torch.float64)
    f = torch.tensor([-50.0, -1e3, 3.0], dtype=torch.float64)
    s = 0.01
    expected = _ema(c, f, 0.9, s)
    reparam_ema_(c, f, 0.9, s)
    assert torch.allclose(c, expected, rtol=1e-14)
    assert (c + s > 0).all()


def test_reparam_never_runs_the_engine_estimate_and_trains(monkeypatch):
    """The engine's curvature estimate is never called with curvature='reparam'."""
    from curvature import CurvatureEngine

    def refuse(*args, **kwargs):
        raise AssertionError("curvature='reparam' must not run the engine's estimate")

    monkeypatch.setattr(CurvatureEngine, "estimate", refuse)
    model, (x, y) = tiny_mlp(), batch()
    opt = VIOptimizer(model, dataset_size=N_DATA, curvature="reparam", seed=0)
    closure = make_closure(opt, model, x, y)
    first = float(opt.step(closure)[0])
    for _ in range(30):
        opt.step(closure)
    assert opt.num_skipped == 0 and float(opt.step(closure)[0]) < first


@pytest.mark.parametrize("kw,err,match", [
    (dict(approx="kfac"), ValueError, "approx='diag'"),
    (dict(curvature_init=None), ValueError, "curvature_init"),
])
def test_reparam_misuse_is_refused(kw, err, match):
    with pytest.raises(err, match=match):
        VIOptimizer(tiny_mlp(), dataset_size=N_DATA, curvature="reparam", **kw)
