"""VIOptimizer's observation noise for ``loss="mse"`` (``noise_variance``, issue 27).

Checked against hand formulas: the first step and the posterior precision with ``N/σ²`` in place
of ``N``; the Bayesian-linear-regression fixed point with noise ``σ² ≠ 1`` against the closed-form
posterior ``P = XᵀX/σ² + δI``, ``μ* = P⁻¹Xᵀy/σ²``; ``predict``'s variance against the samples'
population variance plus ``σ²``; the learned ``σ²`` against the bias-corrected running mean of the
residuals recorded inside the closure.
"""
from __future__ import annotations

import math
from typing import List

import pytest
import torch
from torch import Tensor, nn

from optim_helpers import (full_operator, grad_vec, linreg_data, make_closure, nll, param_vec,
                           reference_curvature, tiny_mlp)
from torchsso2 import VIOptimizer
from torchsso2.optim.noise import MIN_NOISE_VARIANCE, NOISE_EMA_DECAY

N_DATA = 100


def regression_batch(n: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(200 + seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
@pytest.mark.parametrize("sigma2", [0.25, 4.0])
def test_noise_variance_scales_gradient_and_curvature_by_one_over_sigma2(approx, sigma2):
    """Step 1 (no noise, EMA from the first batch): μ1 = μ0 − lr·P⁻¹((N/σ²)·g + τδ·μ0) with
    P = (N/σ²)·C + τδ + damping, and posterior_precision() = P/τ (C, g: the unit-variance ones)."""
    model = tiny_mlp()
    x, y = regression_batch()
    lr, delta, tau, damp = 0.05, 2.0, 0.5, 0.3
    n = N_DATA / sigma2
    c = reference_curvature(model, x, y, loss="mse", approx=approx)
    op = full_operator(model, c.blocks, c.params, n, tau * delta + damp, uncovered_diag=n)
    mu0 = param_vec(model)
    r = n * grad_vec(model, x, y, "mse") + tau * delta * mu0
    opt = VIOptimizer(model, dataset_size=N_DATA, lr=lr, curvature="fisher", approx=approx, loss="mse",
                      prior_precision=delta, kl_weighting=tau, damping=damp, momentum=0.9, curvature_init=None,
                      noise_variance=sigma2)
    opt.step(make_closure(opt, model, x, y, loss="mse"))
    assert torch.allclose(param_vec(model), mu0 - lr * torch.linalg.solve(op, r), rtol=1e-9, atol=1e-12)
    assert torch.allclose(opt.posterior_precision(), op / tau, rtol=1e-10, atol=1e-10)
    assert opt.likelihood_size == pytest.approx(n)


@pytest.mark.parametrize("approx", ["full", "diag"])
def test_bayesian_linear_regression_posterior_with_noise_variance(approx):
    """y = Xw + e, e ~ N(0, 0.5²), noise_variance 0.25: P = XᵀX/σ² + δI (diag: diag(XᵀX)/σ² + δI) exactly,
    and the average of the mean's iterates → μ* = (XᵀX/σ² + δI)⁻¹Xᵀy/σ² within 5 standard deviations of
    the average (the AR(1) argument of tests/test_vi.py::test_bayesian_linear_regression_posterior, with
    XᵀX/σ² in place of XᵀX). With σ² = 1 the fixed point would be elsewhere (checked)."""
    sigma2, prior = 0.25, 20.0
    x, y = linreg_data(n=200, d=3, noise=math.sqrt(sigma2))
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False).double()
    opt = VIOptimizer(model, dataset_size=len(x), lr=0.5, curvature="fisher", approx=approx, loss="mse",
                      prior_precision=prior, damping=0.0, momentum=0.0, seed=0, curvature_init=None,
                      noise_variance=sigma2)
    xtx = x.t() @ x / sigma2
    eye = torch.eye(3, dtype=torch.float64)
    p_full = xtx + prior * eye
    mu_star = torch.linalg.solve(p_full, x.t() @ y / sigma2).reshape(-1)
    expected_p = p_full if approx != "diag" else torch.diag(torch.diag(xtx)) + prior * eye
    closure = make_closure(opt, model, x, y, loss="mse")
    burn_in, k = 60, 300
    contraction = eye - 0.5 * torch.linalg.solve(expected_p, p_full)
    assert float(torch.linalg.eigvals(contraction).abs().max()) < 0.8
    iterates = []
    for t in range(burn_in + k):
        opt.step(closure)
        if t >= burn_in:
            iterates.append(param_vec(model))
    assert torch.allclose(opt.posterior_precision(), expected_p, rtol=0, atol=1e-7)
    sigma = torch.linalg.inv(expected_p)
    cov_avg = torch.linalg.solve(p_full, xtx @ sigma @ xtx) @ torch.linalg.inv(p_full) / k
    tol = 5 * cov_avg.diagonal().sqrt()
    mean = torch.stack(iterates).mean(0)
    assert ((mean - mu_star).abs() < tol).all(), (mean, mu_star, tol)
    unit = torch.linalg.solve(x.t() @ x + prior * eye, x.t() @ y).reshape(-1)  # the σ² = 1 posterior mean
    assert ((unit - mu_star).abs() > 6 * tol).any()


def _fitted(noise_variance, steps: int = 3):
    model = tiny_mlp()
    x, y = regression_batch()
    opt = VIOptimizer(model, dataset_size=N_DATA, lr=0.05, curvature="fisher", loss="mse", seed=0,
                      noise_variance=noise_variance)
    closure = make_closure(opt, model, x, y, loss="mse")
    for _ in range(steps):
        opt.step(closure, targets=y)
    return model, opt, x, y


@pytest.mark.parametrize("noise_variance", [0.3, "learned"])
def test_predict_returns_the_mixture_mean_and_variance(noise_variance):
    """(mean, var) = (mean_s f_s, mean_s (f_s − mean)² + σ²), the moments of (1/S) Σ_s N(f_s, σ²)."""
    model, opt, x, _ = _fitted(noise_variance)
    mean, var = opt.predict(x, num_samples=7, generator=torch.Generator().manual_seed(3), return_variance=True,
                            antithetic=False)
    gen = torch.Generator().manual_seed(3)
    outs = []
    for _ in range(7):
        with opt.sampled_params(generator=gen), torch.no_grad():
            outs.append(model(x))
    f = torch.stack(outs)
    sigma2 = 0.3 if noise_variance == 0.3 else opt.noise.variance
    hand_mean = sum(outs) / 7
    hand_var = sum((o - hand_mean) ** 2 for o in outs) / 7 + sigma2
    assert mean.shape == var.shape == x[:, :3].shape
    assert torch.allclose(mean, hand_mean, rtol=0, atol=1e-14)
    assert torch.allclose(var, hand_var, rtol=1e-12, atol=1e-14)
    assert (var - sigma2).max() > 1e-8  # the samples' spread is part of it
    assert torch.equal(opt.predict(x, num_samples=7, generator=torch.Generator().manual_seed(3), antithetic=False),
                       mean)
    assert f.shape[0] == 7


def test_learned_noise_is_the_running_mean_of_the_squared_residuals_at_the_samples():
    """σ²_t = (1 − β)Σ_k β^(t−k) r_k / (1 − β^t), r_k = mean((y − f(θ_k))²) at step k's weight sample
    (recorded inside the closure), β = NOISE_EMA_DECAY; step t uses N/σ²_t (posterior_precision)."""
    model = tiny_mlp()
    x, y = regression_batch()
    opt = VIOptimizer(model, dataset_size=N_DATA, lr=0.05, curvature="fisher", approx="full", loss="mse",
                      seed=0, noise_variance="learned", ema_decay=0.0, prior_precision=2.0)
    assert opt.noise.variance == 1.0 and opt.observation_variance == 1.0 and opt.noise_variance == "learned"
    residuals: List[float] = []

    def closure():
        opt.zero_grad()
        out = model(x)
        residuals.append(float((y - out.detach()).pow(2).mean()))
        loss = nll("mse", out, y)
        loss.backward()
        return loss, out

    for t in range(1, 5):
        opt.step(closure, targets=y)
        ema = sum((1 - NOISE_EMA_DECAY) * NOISE_EMA_DECAY ** (t - k) * r for k, r in enumerate(residuals, 1))
        expected = ema / (1 - NOISE_EMA_DECAY ** t)
        assert opt.noise.variance == pytest.approx(expected, rel=1e-12)
        assert opt.observation_variance == opt.noise.variance  # the σ² in use, readable as a float
        c = opt.running.blocks
        dense = torch.block_diag(*[b.dense() for b in c.values()])
        eye = torch.eye(dense.shape[0], dtype=dense.dtype)
        assert torch.allclose(opt.posterior_precision(), N_DATA / expected * dense + 2.0 * eye, rtol=1e-10)
    assert residuals[0] != residuals[1]  # different weight samples


def test_learned_noise_has_a_floor_and_survives_a_checkpoint():
    model, opt, x, y = _fitted("learned", steps=2)
    state = opt.state_dict()
    before = opt.noise.variance
    _, other, _, _ = _fitted("learned", steps=0)
    other.load_state_dict(state)
    assert other.noise.variance == before
    opt.noise.update(0.0)
    opt.noise.ema, opt.noise.count = 0.0, 5
    assert opt.noise.variance == MIN_NOISE_VARIANCE


@pytest.mark.parametrize("bad, error", [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), ("fixed", ValueError), (True, TypeError),
                                        ([1.0], TypeError),
                                        # beyond float32 (a raw RuntimeError halfway through the first step)
                                        (1e300, ValueError), (1e-300, ValueError)])
def test_bad_noise_variance_is_refused(bad, error):
    with pytest.raises(error, match="noise_variance"):
        VIOptimizer(tiny_mlp(), dataset_size=10, loss="mse", noise_variance=bad)


def test_noise_variance_needs_mse_and_learned_needs_targets_of_the_output_shape():
    with pytest.raises(ValueError, match="noise_variance.*loss='mse'.*cross_entropy"):
        VIOptimizer(tiny_mlp(), dataset_size=10, noise_variance=0.5)
    model = tiny_mlp()
    x, y = regression_batch()
    opt = VIOptimizer(model, dataset_size=10, loss="mse", noise_variance="learned")
    closure = make_closure(opt, model, x, y, loss="mse")
    before = param_vec(model)
    with pytest.raises(ValueError, match="targets=y"):
        opt.step(closure)
    with pytest.raises(ValueError, match=r"\(12, 3\).*\(12,\).*pass output_selector=lambda out: out\.squeeze"):
        opt.step(closure, targets=y[:, 0])
    assert torch.equal(param_vec(model), before) and opt.num_steps == 0 and opt.noise.count == 0
    ce = VIOptimizer(tiny_mlp(), dataset_size=10, init_precision=1.0)
    with pytest.raises(ValueError, match="return_variance.*mse"):
        ce.predict(x, return_variance=True)


def test_unit_noise_variance_is_the_default():
    """noise_variance=1.0 and the default give bit-identical steps (σ² = 1 is the unit-variance loss)."""
    results: List[Tensor] = []
    for kw in ({}, {"noise_variance": 1.0}):
        model = tiny_mlp()
        x, y = regression_batch()
        opt = VIOptimizer(model, dataset_size=N_DATA, loss="mse", seed=0, **kw)
        assert opt.observation_variance == 1.0
        closure = make_closure(opt, model, x, y, loss="mse")
        for _ in range(3):
            opt.step(closure)
        results.append(param_vec(model))
    assert torch.equal(results[0], results[1])
