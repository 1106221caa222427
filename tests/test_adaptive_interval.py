"""``adaptive_coefficients_interval``: the adaptive step solves its coefficients every k steps (and at the
first two and at every LM step) and reuses the last ones in between (torchsso2/optim/adaptive.py)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2.optim import SecondOrderOptimizer
from torchsso2.optim.adaptive import AdaptiveCoefficients

from optim_helpers import make_closure, param_vec


def _linear_problem():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 5, generator=g, dtype=torch.float64), torch.randn(40, 3, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    return nn.Linear(5, 3).double(), x, y


def _loss(model, theta, x, y):
    w, b = theta[:15].view(3, 5), theta[15:]
    return 0.5 * (F.linear(x, w, b) - y).pow(2).sum(1).mean()


def test_between_solves_the_step_takes_the_last_coefficients_with_the_new_direction(monkeypatch):
    model, x, y = _linear_problem()
    lam = 0.05
    opt = SecondOrderOptimizer(model, curvature="fisher", approx="full", loss="mse", damping=lam, ema_decay=0.0,
                               use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                               adaptive_coefficients_interval=3)
    solved = []
    original = AdaptiveCoefficients.coefficients
    monkeypatch.setattr(AdaptiveCoefficients, "coefficients",
                        lambda self, *a: solved.append(self.last["steps"]) or original(self, *a))
    closure = make_closure(opt, model, x, y, "mse")
    prev, last = None, None
    for step in range(8):
        theta = param_vec(model).clone()
        d = torch.autograd.functional.jacobian(lambda t: _loss(model, t, x, y), theta)
        hess = torch.autograd.functional.hessian(lambda t: _loss(model, t, x, y), theta)
        delta = torch.linalg.solve(hess + lam * torch.eye(len(theta), dtype=torch.float64), d)  # Δ, exact here
        n_solved = len(solved)
        opt.step(closure)
        new = param_vec(model)
        now = dict(opt.adaptive.last)
        if step in (0, 1) or step % 3 == 0:
            assert len(solved) == n_solved + 1 and math.isfinite(now["quad_model"])
        else:  # reused: the previous step's α, μ with this step's Δ and δ_prev, no model value
            assert len(solved) == n_solved and math.isnan(now["quad_model"])
            assert (now["learning_rate"], now["momentum"]) == (last["learning_rate"], last["momentum"])
            expected = theta - now["learning_rate"] * delta + now["momentum"] * prev
            torch.testing.assert_close(new, expected, rtol=0, atol=1e-10)
        assert now["steps"] == step + 1
        prev, last = new - theta, now
    assert solved == [0, 1, 3, 6]


def _digits_like(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)


def test_lm_steps_always_solve_and_a_checkpoint_resumes_bit_exactly(monkeypatch):
    model, x, y = _digits_like()
    kw = dict(approx="kfac", damping=0.1, adaptive_damping=True, damping_adaptation_interval=4,
              curv_update_interval=2, inv_update_interval=4, use_adaptive_learning_rate=True,
              use_adaptive_momentum=True, adaptive_coefficients_interval=5, seed=0)
    opt = SecondOrderOptimizer(model, **kw)
    closure = make_closure(opt, model, x, y)
    fed = []
    original = SecondOrderOptimizer._adapt_damping
    monkeypatch.setattr(SecondOrderOptimizer, "_adapt_damping",
                        lambda self, *a, **k: fed.append(a[5]) or original(self, *a, **k))  # a[5]: predicted
    for _ in range(7):
        opt.step(closure)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for _ in range(9):
        opt.step(closure)
    assert len(fed) == 4 and all(math.isfinite(v) for v in fed)  # steps 3, 7, 11, 15: each got a model value
    clone, _, _ = _digits_like(seed=4)
    clone.load_state_dict(saved_model)
    other = SecondOrderOptimizer(clone, **kw)
    other.load_state_dict(saved_opt)
    closure2 = make_closure(other, clone, x, y)
    for _ in range(9):
        other.step(closure2)
    assert other.damping == opt.damping
    for k, v in opt.adaptive.last.items():  # quad_model is NaN after a step that reused the coefficients
        assert other.adaptive.last[k] == v or (math.isnan(v) and math.isnan(other.adaptive.last[k])), k
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)


def test_interval_one_is_the_default_and_bad_values_are_refused():
    model, x, y = _digits_like()
    assert SecondOrderOptimizer(model, use_adaptive_learning_rate=True).adaptive.interval == 1
    with pytest.raises(ValueError, match="adaptive_coefficients_interval=0"):
        SecondOrderOptimizer(model, use_adaptive_learning_rate=True, adaptive_coefficients_interval=0)
    with pytest.raises(TypeError, match="adaptive_coefficients_interval"):
        SecondOrderOptimizer(model, use_adaptive_learning_rate=True, adaptive_coefficients_interval=2.0)
    with pytest.raises(ValueError, match="needs use_adaptive_learning_rate"):
        SecondOrderOptimizer(model, adaptive_coefficients_interval=3)
