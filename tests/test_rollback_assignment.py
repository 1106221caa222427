"""A step rolled back (an exception after its decomposition: adaptive mode's J·v pass, the LM rule's closure
call) puts back the work assignment with the decompositions it restores: with several processes a new
block placed every decomposition anew, and the old ones sit where the old assignment put them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer
from torchsso2.optim.rollback import CurvatureRollback


def test_restore_puts_the_assignment_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = SecondOrderOptimizer(model, approx="kfac")
    before = object()
    opt.placement.assignment = before  # (one process has none: stands for the one the step started with)
    rollback = CurvatureRollback(opt, statistics=True)
    opt.placement.assignment = object()  # a new block placed everything anew inside the step
    rollback.restore(opt, KeyboardInterrupt())
    assert opt.placement.assignment is before


def test_a_step_raising_in_the_lm_call_keeps_the_assignment_it_started_with() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = SecondOrderOptimizer(model, approx="kfac", adaptive_damping=True, damping_adaptation_interval=1)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    calls = []
    before = object()
    opt.placement.assignment = before

    def closure():
        calls.append(1)
        if len(calls) == 2:  # the LM rule's call, after the step's decomposition
            opt.placement.assignment = object()
            raise KeyboardInterrupt
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss
    with pytest.raises(KeyboardInterrupt):
        opt.step(closure)
    assert opt.placement.assignment is before
