"""``curv_warmup_steps``: the first steps of SecondOrderOptimizer estimate and decompose every step,
the intervals apply afterwards (checked against hand-computed natural-gradient steps, float64)."""
from __future__ import annotations

import pytest
import torch

from optim_helpers import batch, make_closure, param_vec, tiny_mlp
from test_second_order import hand_update
from torchsso2 import SecondOrderOptimizer


def test_warmup_steps_estimate_and_decompose_every_step_then_the_intervals_apply():
    """warm-up 3, intervals 5, ema_decay 0: steps 1-3 are each preconditioned by their own batch's
    exact Fisher; step 4 (index 3: in no warm-up, not a multiple of 5) reuses step 3's."""
    model = tiny_mlp()
    lr, lam = 0.1, 1e-2
    opt = SecondOrderOptimizer(model, kl_clip=None, lr=lr, momentum=0.0, curvature="fisher", approx="full",
                               damping=lam, ema_decay=0.0, curv_update_interval=5, inv_update_interval=5,
                               curv_warmup_steps=3)
    blocks = None
    for i in range(3):
        x, y = batch(seed=i + 1)
        delta, _, c = hand_update(model, x, y, approx="full", damping=lam)
        theta = param_vec(model)
        opt.step(make_closure(opt, model, x, y))
        assert torch.allclose(param_vec(model), theta - lr * delta, rtol=1e-9, atol=1e-11), f"step {i + 1}"
        blocks = c.blocks
    x, y = batch(seed=4)
    delta, _, _ = hand_update(model, x, y, approx="full", damping=lam, blocks=blocks)
    theta = param_vec(model)
    opt.step(make_closure(opt, model, x, y))
    assert torch.allclose(param_vec(model), theta - lr * delta, rtol=1e-9, atol=1e-11)


def test_zero_warmup_steps_is_the_interval_schedule():
    """The default (0) leaves the schedule alone: step 2 at interval 5 reuses step 1's curvature."""
    runs = []
    for kw in (dict(), dict(curv_warmup_steps=0)):
        model = tiny_mlp()
        opt = SecondOrderOptimizer(model, lr=0.1, curvature="fisher", approx="full", damping=1e-2,
                                   curv_update_interval=5, inv_update_interval=5, **kw)
        for i in range(3):
            x, y = batch(seed=i + 1)
            opt.step(make_closure(opt, model, x, y))
        runs.append(param_vec(model))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("value,exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("3", TypeError)])
def test_bad_warmup_steps_are_refused(value, exc):
    with pytest.raises(exc, match="curv_warmup_steps(=| must be an int)"):
        SecondOrderOptimizer(tiny_mlp(), curv_warmup_steps=value)
