"""VIOptimizer.predict's antithetic samples (the default): pairs ``μ + ε``, ``μ − ε`` from one draw.

Checked by brute force on a linear model ``f(θ) = Xθ`` (float64), where everything is exact: the
pairs are the public ``sampled_params`` draws and their reflections through ``μ``; a pair's average
is ``f(μ)`` exactly; and the samples are still posterior samples (their spread estimates
``x Σ xᵀ + σ²`` with ``Σ = posterior_precision()⁻¹``).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from optim_helpers import linreg_data, make_closure, param_vec
from torchsso2 import VIOptimizer


def _fitted_linear(approx: str = "diag", noise_variance: float = 0.5):
    x, y = linreg_data(n=40, d=3)
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False).double()
    kw = {} if approx == "diag" else {"curvature": "fisher"}
    opt = VIOptimizer(model, dataset_size=40, lr=0.1, approx=approx, loss="mse", noise_variance=noise_variance, seed=0,
                      **kw)
    closure = make_closure(opt, model, x, y, loss="mse")
    for _ in range(3):
        opt.step(closure)
    return model, opt, x


@pytest.mark.parametrize("approx", ["diag", "full"])
def test_antithetic_samples_are_each_draw_and_its_reflection_through_the_mean(approx: str) -> None:
    """num_samples=5: draws w1, w2, w3 (the same generator stream as sampled_params) give the samples
    w1, 2μ − w1, w2, 2μ − w2, w3; mean and variance are those of the five outputs."""
    model, opt, x = _fitted_linear(approx)
    mu = param_vec(model)
    mean, var = opt.predict(x, num_samples=5, generator=torch.Generator().manual_seed(4), return_variance=True)
    gen = torch.Generator().manual_seed(4)
    draws = []
    for _ in range(3):
        with opt.sampled_params(gen):
            draws.append(param_vec(model))
    weights = [draws[0], 2 * mu - draws[0], draws[1], 2 * mu - draws[1], draws[2]]
    outs = torch.stack([x @ w.unsqueeze(1) for w in weights])
    torch.testing.assert_close(mean, outs.mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(var, outs.var(0, unbiased=False) + 0.5, rtol=1e-12, atol=1e-12)
    assert torch.equal(param_vec(model), mu)  # the weights are back


def test_an_even_number_of_antithetic_samples_averages_a_linear_model_to_its_mean_weights() -> None:
    model, opt, x = _fitted_linear()
    with torch.no_grad():
        plug_in = model(x)
    anti = opt.predict(x, num_samples=8, generator=torch.Generator().manual_seed(1))
    iid = opt.predict(x, num_samples=8, generator=torch.Generator().manual_seed(1), antithetic=False)
    torch.testing.assert_close(anti, plug_in, rtol=0, atol=1e-12)  # the linear Monte-Carlo error is gone
    assert float((iid - plug_in).abs().max()) > 1e-4  # independent samples keep it


def test_antithetic_samples_are_posterior_samples() -> None:
    """The spread of 4000 antithetic samples estimates the exact predictive variance x Σ xᵀ + σ².
    A pair's two deviations from the mean are ±δ (one square), so 4000 samples hold 2000 independent
    squares: the relative standard error of the estimate is √(2/2000) ≈ 3.2 %; tolerance 5 of them."""
    model, opt, x = _fitted_linear()
    cov = torch.linalg.inv(opt.posterior_precision())  # [3, 3]: the covariance of ε
    exact = (x @ cov * x).sum(1, keepdim=True)  # [N, 1]
    _, var = opt.predict(x, num_samples=4000, generator=torch.Generator().manual_seed(2), return_variance=True)
    rel = ((var - 0.5) / exact - 1).abs().max()
    assert float(rel) < 5 * (2 / 2000) ** 0.5, float(rel)


def test_antithetic_must_be_a_bool() -> None:
    _, opt, x = _fitted_linear()
    with pytest.raises(TypeError, match="antithetic must be a bool"):
        opt.predict(x, num_samples=2, antithetic=1)


def test_default_sampling_generator_is_reseeded_by_the_step_count() -> None:
    """sampling_generator() (the default of predict and sampled_params) is documented as seeded from
    ``seed`` AND the step count: at one step every call draws the same noise (reproducible), after a
    step it draws new noise. Checked on the standardized draws ε = (w − μ)·√precision of the default
    sampled_params (diag posterior, so precision is diagonal; float64, 1e-12 is rounding): equal within
    a step, different after one (4 fresh standard normals all within 0.1 of the old ones: ~1e-5 likely)."""
    x, y = linreg_data(n=40, d=3)
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    opt = VIOptimizer(model, dataset_size=40, lr=0.1, loss="mse", noise_variance=0.5, seed=0)
    closure = make_closure(opt, model, x, y, loss="mse")

    def eps() -> torch.Tensor:
        mu, prec = param_vec(model), opt.posterior_precision()
        assert torch.equal(prec, torch.diag(prec.diagonal()))
        with opt.sampled_params():
            w = param_vec(model)
        return (w - mu) * prec.diagonal().sqrt()

    opt.step(closure)
    first = eps()
    torch.testing.assert_close(eps(), first, rtol=1e-12, atol=1e-12)
    opt.step(closure)
    second = eps()
    assert float((second - first).abs().max()) > 0.1
    torch.testing.assert_close(eps(), second, rtol=1e-12, atol=1e-12)
