"""Long runs and lifecycle: adaptive mode after a zero-loss batch, a KFACPreconditioner's model copied
with its hooks, a closure raising in the LM rule's call."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer
from torchsso2.kfac import KFACPreconditioner


def _step(opt, model, x, y):
    return opt.step(make_closure(opt, model, x, y))[0]


def test_adaptive_mode_trains_on_after_a_batch_whose_loss_is_zero(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(32, 10), torch.randint(0, 3, (32,))
    opt = SecondOrderOptimizer(model, seed=0, use_adaptive_learning_rate=True, use_adaptive_momentum=True)
    for _ in range(3):
        _step(opt, model, x, y)
    with torch.no_grad():
        model[2].bias[0] += 40.0  # every example confidently class 0: the float32 loss rounds to 0
    assert float(_step(opt, model, x, torch.zeros(32, dtype=torch.long)).detach()) == 0.0
    assert opt.adaptive.last["learning_rate"] == 0.0  # within the objective 0: no update
    with torch.no_grad():
        model[2].bias[0] -= 40.0
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    losses = []
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            losses.append(float(_step(opt, model, x, y).detach()))
    assert opt.num_skipped == 0 and "not positive definite" not in caplog.text
    assert not torch.equal(before, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert losses[-1] < losses[0]


def _kfac_run(train_copy: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    pre = KFACPreconditioner(model, accumulation_steps=2, factor_update_steps=1, inv_update_steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin = copy.deepcopy(model)  # carries the preconditioner's hooks
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        if train_copy:  # the copy trains alongside, one forward per step, before the original's micro-batches
            twin_opt.zero_grad()
            F.cross_entropy(twin(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
            twin_opt.step()
        opt.zero_grad()
        for _ in range(2):
            x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
            (F.cross_entropy(model(x), y) / 2).backward()
        pre.step()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_training_a_deep_copy_leaves_the_original_preconditioner_alone() -> None:
    assert torch.equal(_kfac_run(True), _kfac_run(False))


def test_a_closure_raising_in_the_lm_rules_call_undoes_the_update() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    opt = SecondOrderOptimizer(model, adaptive_damping=True, damping_adaptation_interval=1)
    calls = {"n": 0}

    def closure():
        calls["n"] += 1
        if calls["n"] == 2:  # the LM rule's second call of the first step
            raise KeyboardInterrupt
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(KeyboardInterrupt):
        opt.step(closure)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # as if never called
    assert opt.num_steps == 0 and not opt.state_dict()["state"]
    opt.step(closure)  # and the run goes on
    assert opt.num_steps == 1
