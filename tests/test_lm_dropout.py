"""The LM rule's loss after the update draws the dropout masks of the step's own closure call (the RNG states
are replayed, as kfac-jax evaluates both losses with the step's one key): ρ ≈ 1 for a small step of a
dropout net, as without dropout; the user's random streams are left as the step's closure call left them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer


def _dropout_mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3)).double()


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (32,), generator=g)


@pytest.mark.parametrize("mode", ["closure", "forward_only"])
def test_rho_of_a_small_step_of_a_dropout_net_is_one(mode):
    """``closure``: the LM rule calls the closure again (fixed lr); ``forward_only``: adaptive mode given the
    targets evaluates one forward of the recorded call. Before, the second evaluation drew a new mask and
    ρ ranged over [−90, 28]."""
    model = _dropout_mlp()
    x, y = _data()
    kw = dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True) if mode == "forward_only" \
        else dict(lr=1e-3, kl_clip=None, momentum=0.0)
    opt = SecondOrderOptimizer(model, curvature="fisher", approx="full", adaptive_damping=True,
                               damping_adaptation_interval=1, damping=10.0 if mode == "forward_only" else 0.1,
                               seed=0, **kw)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    rhos = []
    for _ in range(6):
        opt.step(closure, targets=y) if mode == "forward_only" else opt.step(closure)
        rhos.append(opt.lm.last_rho)
    low, high = (0.9, 1.1) if mode == "closure" else (0.5, 2.0)  # adaptive steps are not small: the model's
    assert all(low < r < high for r in rhos), rhos                  # damping term puts ρ above 1 (docs/adaptive.md)


def test_the_step_leaves_the_random_stream_as_its_closure_call_left_it():
    """With or without the LM rule's evaluation, the global generator after the step is where the closure's own
    draws left it."""
    states = []
    for adaptive_damping in (False, True):
        model = _dropout_mlp()
        x, y = _data()
        opt = SecondOrderOptimizer(model, curvature="fisher", approx="full", lr=1e-3, kl_clip=None,
                                   adaptive_damping=adaptive_damping, damping_adaptation_interval=1, seed=0)

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        torch.manual_seed(5)
        opt.step(closure)
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], states[1])
