"""The Levenberg–Marquardt rule's evaluation after the update: an update after which the loss is not
finite is undone (parameters, momentum, adaptive state, closure's streams; the curvature keeps the
batch) and the step is skipped, or raised under ``on_nonfinite="raise"``; a step the quadratic model predicts no change for
(a zero gradient) leaves the damping alone."""
from __future__ import annotations

import math

import pytest

import torch
from torch import nn

from torchsso2 import SecondOrderOptimizer
from torchsso2.optim.damping import LMDamping
from torchsso2.optim.skips import NonFiniteError


def _state_tensors(opt: SecondOrderOptimizer) -> list:
    """Every tensor of the optimizer's checkpoint but its curvature, in a fixed order (the curvature keeps
    the batch, whose statistics are finite, as for a non-finite update)."""
    out = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x.detach().clone())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                if k != "curvature":
                    walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(opt.state_dict())
    return out


def _setup(adaptive: bool, on_nonfinite: str):
    torch.manual_seed(0)
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    kw = dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True) if adaptive else dict(lr=0.1)
    opt = SecondOrderOptimizer(model, loss="mse", adaptive_damping=True, damping_adaptation_interval=2,
                               on_nonfinite=on_nonfinite, seed=0, **kw)
    calls = {"n": 0, "poison": None}

    def closure():
        calls["n"] += 1
        opt.zero_grad()
        out = model(x)
        loss = 0.5 * (out - y).pow(2).sum(1).mean()
        loss.backward()
        if calls["n"] == calls["poison"]:
            return loss * math.inf, out  # the loss the LM rule sees after the update
        return loss, out
    return model, opt, closure, calls


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_nonfinite_loss_after_the_update_undoes_it_and_skips_the_step(adaptive):
    model, opt, closure, calls = _setup(adaptive, "skip")
    opt.step(closure)  # step 0: no LM evaluation (interval 2)
    params = [p.detach().clone() for p in model.parameters()]
    state = _state_tensors(opt)
    damping = opt.damping
    calls["poison"] = calls["n"] + 2  # step 1's second closure call: the LM rule's evaluation
    opt.step(closure)
    assert opt.num_skipped == 1 and opt.num_steps == 1
    assert opt.lm.last_rho == -math.inf
    assert opt.damping == pytest.approx(damping / opt.lm.decay)  # the rule's answer to a failed step
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    after = _state_tensors(opt)
    assert len(after) == len(state) and all(torch.equal(a, b) for a, b in zip(after, state))
    # training goes on: the next step is taken, the LM rule evaluated at the same step index
    opt.step(closure)
    assert opt.num_steps == 2 and opt.num_skipped == 1 and math.isfinite(opt.lm.last_rho)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("adaptive", [False, True])
def test_under_raise_the_update_is_undone_before_the_error(adaptive):
    model, opt, closure, calls = _setup(adaptive, "raise")
    opt.step(closure)
    params = [p.detach().clone() for p in model.parameters()]
    state = _state_tensors(opt)
    damping = opt.damping
    calls["poison"] = calls["n"] + 2
    with pytest.raises(NonFiniteError, match="loss after the update"):
        opt.step(closure)
    assert opt.num_steps == 1 and opt.damping == damping
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    after = _state_tensors(opt)
    assert all(torch.equal(a, b) for a, b in zip(after, state))


def test_an_update_that_diverges_is_not_kept():
    """An lr far too large for exp-output regression: the loss after the first update is inf. Before,
    the update was kept (every later batch non-finite, the run stalled with spoilt parameters)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    model = nn.Sequential(nn.Linear(6, 3))
    w0 = model[0].weight.detach().clone()
    opt = SecondOrderOptimizer(model, lr=1e3, momentum=0.0, loss="mse", kl_clip=None, adaptive_damping=True,
                               damping_adaptation_interval=1)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = 0.5 * (torch.exp(3 * out) - y).pow(2).sum(1).mean()
        loss.backward()
        return loss, out
    opt.step(closure)
    assert opt.num_skipped == 1 and torch.equal(model[0].weight, w0)


def test_no_predicted_and_no_actual_change_leaves_the_damping():
    lm = LMDamping(0.1, decay=0.5)
    assert lm.update(0.0, 0.0) == 0.1 and math.isnan(lm.last_rho)
    assert lm.update(math.nan, math.nan) == pytest.approx(0.2) and lm.last_rho == -math.inf
    assert LMDamping(0.1, decay=0.5).update(0.0, 1e-3) == pytest.approx(0.2)  # an uphill model: more damping


def test_an_exactly_fitted_batch_keeps_the_damping():
    torch.manual_seed(0)
    x = torch.randn(16, 4)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    with torch.no_grad():
        y = model(x)
    opt = SecondOrderOptimizer(model, loss="mse", adaptive_damping=True, damping_adaptation_interval=1, damping=0.1)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = 0.5 * (out - y).pow(2).sum(1).mean()
        loss.backward()
        return loss, out
    for _ in range(10):
        opt.step(closure)
    assert opt.damping == 0.1 and opt.num_skipped == 0
