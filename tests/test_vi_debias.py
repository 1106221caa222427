"""VIOptimizer(momentum_debias=...): IVON's momentum bias correction of the mean's step (issue 27).

* the first step by hand: ``μ1 = μ0 − lr/(1 − β)·N·Λ1⁻¹·m1`` (the reparam step's formula with the
  bias-corrected lr; gradients by plain autograd at the recorded weight sample);
* every step is the uncorrected step at ``lr/(1 − β^t)`` (flat diag path with and without the KL
  clip, and the general path of noisy K-FAC), and differs from the uncorrected step at ``lr``;
* a skipped (non-finite) step does not advance ``t``;
* misuse is refused.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Optional

import pytest
import torch
from torch import Tensor

from optim_helpers import batch, grad_vec, make_closure, param_vec, set_params, tiny_mlp
from torchsso2 import VIOptimizer
from torchsso2.optim.vi_start import debias_factor

N_DATA = 100


def _ema(c: Tensor, f: Tensor, beta: float, s: float) -> Tensor:
    return beta * c + (1 - beta) * f + 0.5 * (1 - beta) ** 2 * (c - f) ** 2 / (c + s)


def test_first_step_is_the_steady_state_length_by_hand():
    """Step 1 with ``m1 = g(θ1) + τδ/N·μ0`` (a fresh buffer) moves ``lr/(1 − β)`` along ``N·Λ1⁻¹m1``:
    as long as a step whose buffer holds the same gradient at steady state, ``m = g/(1 − β)``."""
    model = tiny_mlp()
    x, y = batch(seed=1)
    lr, delta, mom, beta, h = 0.05, 2.0, 0.9, 0.9, 0.4
    opt = VIOptimizer(model, dataset_size=N_DATA, lr=lr, prior_precision=delta, momentum=mom, ema_decay=beta,
                      curvature_init=h, kl_clip=None, seed=7, momentum_debias=True)
    seen: List[Dict[str, Tensor]] = []
    mu0 = param_vec(model)
    opt.step(make_closure(opt, model, x, y, record=seen))
    sample = set_params(tiny_mlp(), seen[0])
    eps, g = param_vec(sample) - mu0, grad_vec(sample, x, y)
    c1 = _ema(torch.full_like(mu0, h), g * eps * (N_DATA * h + delta), beta, delta / N_DATA)
    m1 = g + delta / N_DATA * mu0
    expected = mu0 - lr / (1 - mom) * N_DATA * m1 / (N_DATA * c1 + delta)
    assert torch.allclose(param_vec(model), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("approx,kl_clip", [("diag", 0.1), ("diag", None), ("kfac", 0.1)])
def test_every_step_is_the_uncorrected_step_at_the_corrected_lr(approx: str, kl_clip: Optional[float]):
    """``momentum_debias=True`` at ``lr`` equals ``momentum_debias=False`` whose lr is set to
    ``lr/(1 − β^t)`` before step t (same seed, so the same weight noise), step after step; the plain
    run at ``lr`` ends elsewhere."""
    lr, mom, steps = 0.3, 0.8, 6
    models = [tiny_mlp() for _ in range(3)]
    kw = dict(dataset_size=N_DATA, approx=approx, momentum=mom, kl_clip=kl_clip, seed=3)
    debiased = VIOptimizer(models[0], lr=lr, momentum_debias=True, **kw)
    scheduled = VIOptimizer(models[1], lr=lr, momentum_debias=False, **kw)
    plain = VIOptimizer(models[2], lr=lr, momentum_debias=False, **kw)
    for t in range(1, steps + 1):
        x, y = batch(seed=t)
        for group in scheduled.param_groups:
            group["lr"] = lr / (1 - mom ** t)
        for opt, model in zip((debiased, scheduled, plain), models):
            opt.step(make_closure(opt, model, x, y))
        assert torch.allclose(param_vec(models[0]), param_vec(models[1]), rtol=1e-10, atol=1e-12), t
    assert (param_vec(models[0]) - param_vec(models[2])).abs().max() > 1e-3


def test_a_skipped_step_does_not_advance_the_correction():
    """A non-finite step leaves the buffers alone, so the next step is still step 1 of the correction."""
    lr, mom = 0.2, 0.9
    model, twin = tiny_mlp(), tiny_mlp()
    opt = VIOptimizer(model, dataset_size=N_DATA, lr=lr, momentum=mom, seed=5, momentum_debias=True)
    ref = VIOptimizer(twin, dataset_size=N_DATA, lr=lr, momentum=mom, seed=5, momentum_debias=True)
    x, y = batch(seed=1)

    def poison() -> None:
        next(model.parameters()).grad.fill_(float("nan"))

    opt.step(make_closure(opt, model, x, y, after_backward=poison))
    assert opt.num_skipped == 1 and torch.equal(param_vec(model), param_vec(twin))
    opt.step(make_closure(opt, model, x, y))
    ref.step(make_closure(ref, twin, x, y))
    assert torch.allclose(param_vec(model), param_vec(twin), rtol=1e-12, atol=1e-14)


def test_debias_factor():
    assert debias_factor(0.9, 1) == pytest.approx(10.0)
    assert debias_factor(0.9, 2) == pytest.approx(1 / 0.19)
    assert debias_factor(0.0, 1) == 1.0
    assert debias_factor(0.9, 10_000) == 1.0
    with pytest.raises(ValueError, match="step >= 1"):
        debias_factor(0.9, 0)


def test_momentum_debias_must_be_a_bool():
    with pytest.raises(TypeError, match="momentum_debias must be a bool"):
        VIOptimizer(tiny_mlp(), dataset_size=N_DATA, momentum_debias=1)  # type: ignore[arg-type]


def test_momentum_debias_survives_a_deepcopy():
    opt = VIOptimizer(tiny_mlp(), dataset_size=N_DATA, momentum_debias=True)
    assert copy.deepcopy(opt).momentum_debias is True
