"""VIOptimizer: a covered layer frozen before the first step and unfrozen later becomes Bayesian.

With the default diagonal (``curvature="reparam"``) the estimate ``ĥ = g·ε/σ²`` comes from the
sample's own noise and the noise from the running blocks: a layer with no block was never sampled
and never got one (a point estimate, silently). Now it starts at ``curvature_init·I`` when it is
unfrozen, as the other curvature kinds start a block first seen later.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import VIOptimizer

N = 100


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 5, generator=gen)
    return x, (x[:, 0] > 0).long()


def _train(approx: str, unfreeze_at: int, steps: int, seen=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = VIOptimizer(model, dataset_size=N, lr=1e-2, seed=1, approx=approx)
    model[0].requires_grad_(False)
    x, y = _data()
    for i in range(steps):
        if i == unfreeze_at:
            model[0].requires_grad_(True)
        xb, yb = x[i * 10:(i + 1) * 10], y[i * 10:(i + 1) * 10]

        def closure():
            opt.zero_grad()
            if seen is not None and i == unfreeze_at:
                seen.append((model[0].weight.detach().clone(), model[0].bias.detach().clone()))
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            return loss
        opt.step(closure)
    return model, opt


@pytest.mark.parametrize("approx", ["diag", "kfac"])
def test_a_layer_unfrozen_after_the_first_steps_is_sampled_and_gets_a_posterior(approx: str) -> None:
    model, opt = _train(approx, unfreeze_at=5, steps=5)
    assert set(opt.running.blocks) == {"2"}  # frozen so far: no block, not sampled
    # posterior_variance() says so (it raised KeyError for the layer's weight: no entry)
    assert bool((opt.posterior_variance()[model[0].weight] == 0).all())
    mean_w, mean_b = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    seen = []
    # the diagonal's estimate comes from every step; K-FAC's at its next curvature step
    model, opt = _train(approx, unfreeze_at=5, steps=6 if approx == "diag" else 5 + 2 * opt.curv_update_interval,
                        seen=seen)
    assert set(opt.running.blocks) == {"0", "2"}
    variance = opt.posterior_variance()
    assert model[0].weight in variance and bool((variance[model[0].weight] > 0).all())
    if approx == "diag":
        # the unfreezing step samples the layer at once from N(μ, τ/(N·curvature_init + τδ + damping))
        opt_ = VIOptimizer(nn.Linear(1, 1), dataset_size=N)
        sd = (opt_.kl_weighting / (N * opt_.curvature_init + opt_.precision_shift)) ** 0.5
        noise = torch.cat([(seen[0][0] - mean_w).flatten(), (seen[0][1] - mean_b).flatten()]) / sd
        # 48 draws of N(0, 1): their sample standard deviation within 0.6–1.4 (more than 4 standard errors)
        assert noise.abs().max() > 0 and 0.6 < float(noise.std()) < 1.4
        # and its block moved from curvature_init by the reparam estimate of that step
        assert not torch.allclose(opt.running.blocks["0"].diagonal,
                                  torch.full_like(opt.running.blocks["0"].diagonal, opt.curvature_init))


def test_a_layer_frozen_since_construction_and_never_unfrozen_stays_a_point_estimate() -> None:
    model, opt = _train("diag", unfreeze_at=math.inf, steps=8)  # type: ignore[arg-type]
    assert set(opt.running.blocks) == {"2"}
    assert model[0].weight not in opt.posterior_variance() or \
        bool((opt.posterior_variance()[model[0].weight] == 0).all())


@pytest.mark.parametrize("face", ["sso", "vi-kfac", "vi-diag-fisher"])
def test_a_failed_decomposition_at_the_step_a_layer_joins_skips_it(face: str) -> None:
    """The step that first sees an unfrozen layer decomposes every block; when that fails (skip policy)
    the others keep their decompositions for the step, but the new block had none and the step raised
    'call decompose() before solve()'. Now it leaves the curvature and joins at the next step."""
    from optim_helpers import failing_decompositions
    from torchsso2 import SecondOrderOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    if face == "sso":
        opt = SecondOrderOptimizer(model, seed=1)
    else:
        opt = VIOptimizer(model, dataset_size=N, seed=1, approx="kfac" if face == "vi-kfac" else "diag",
                          curvature="fisher_mc", curv_update_interval=1, inv_update_interval=1)
    model[0].requires_grad_(False)
    x, y = _data()
    with failing_decompositions() as failing:
        _six_steps_failing_at_3(opt, model, x, y, failing)
    assert set(opt.running.blocks) == {"0", "2"}
    assert all(b.decomposition is not None for b in opt.running.blocks.values())
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _six_steps_failing_at_3(opt, model, x, y, failing) -> None:
    for i in range(6):
        if i == 3:
            model[0].requires_grad_(True)
        failing["now"] = i == 3
        xb, yb = x[i * 10:(i + 1) * 10], y[i * 10:(i + 1) * 10]

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            return loss
        opt.step(closure)
        if i == 3:
            assert "0" not in opt.running.blocks and opt.num_skipped == 1
