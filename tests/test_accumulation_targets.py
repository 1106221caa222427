"""Gradient accumulation and targets in the native optimizers (issue 28 items 9 and 10).

* ``empirical_fisher`` with ``targets`` (all micro-batches' targets, concatenated) supports several
  forwards per closure and equals one big batch; without targets one message states the
  limitation and the fix; targets of the wrong length are refused, never used silently;
* ``curvature="hessian"`` without targets names the fix ``step(closure, targets=y)``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_reliability import _closure, _data, _flat, _mlp
from torchsso2 import SecondOrderOptimizer, VIOptimizer


def _make(face, model, kind, approx, **kw):
    damping = 10.0 if kind == "hessian" else 1e-1  # the Hessian is indefinite: damp it positive definite
    if face == "sso":
        return SecondOrderOptimizer(model, lr=0.1, curvature=kind, approx=approx, damping=damping, seed=0, **kw)
    return VIOptimizer(model, dataset_size=1000, lr=0.05, curvature=kind, approx=approx, prior_precision=1.0,
                       damping=damping * 1000, seed=0, **kw)


@pytest.mark.parametrize("face", ["sso", "vi"])
@pytest.mark.parametrize("approx", ["kfac", "diag", "full"])
def test_empirical_fisher_accumulation_with_targets_equals_one_big_batch(face, approx):
    x, y = _data(32)
    results = []
    for micro in (1, 4):
        model = _mlp()
        opt = _make(face, model, "empirical_fisher", approx)
        for _ in range(3):
            opt.step(_closure(opt, model, x, y, micro=micro), targets=y)
        assert opt.num_skipped == 0
        results.append(_flat(model))
    assert torch.allclose(results[0], results[1], atol=1e-10, rtol=1e-9)
    assert (results[0] - _flat(_mlp())).abs().max() > 1e-4


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_empirical_fisher_accumulation_without_targets_names_the_limitation_and_the_fix(face):
    x, y = _data(32)
    model = _mlp()
    opt = _make(face, model, "empirical_fisher", "kfac")
    before = _flat(model)
    with pytest.raises(ValueError, match=r"supports one forward per closure.*step\(closure, targets=y\)") as err:
        opt.step(_closure(opt, model, x, y, micro=2))
    assert "called more than once" not in str(err.value)
    assert torch.equal(_flat(model), before) and opt.num_steps == 0
    opt.step(_closure(opt, model, x, y, micro=1))  # one forward per closure works without targets
    assert opt.num_steps == 1


@pytest.mark.parametrize("face", ["sso", "vi"])
@pytest.mark.parametrize("rows", [8, 24, 40])
def test_targets_of_the_wrong_length_are_refused(face, rows):
    """The closure runs 4 micro-batches of 8: targets must have 32 rows (8 would be the first
    micro-batch's targets, used for every micro-batch before this check)."""
    x, y = _data(32)
    model = _mlp()
    opt = _make(face, model, "empirical_fisher", "diag")
    targets = torch.cat([y, y])[:rows]
    with pytest.raises(ValueError, match=f"targets has {rows} rows"):
        opt.step(_closure(opt, model, x, y, micro=4), targets=targets)


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_hessian_without_targets_names_the_fix(face):
    x, y = _data(16)
    model = _mlp()
    opt = _make(face, model, "hessian", "full")

    def closure():  # README's closure
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out
    before = _flat(model)
    with pytest.raises(ValueError, match=r"opt\.step\(closure, targets=y\)"):
        opt.step(closure)
    assert opt.num_steps == 0
    opt.step(closure, targets=y)
    assert opt.num_steps == 1 and opt.num_skipped == 0 and torch.isfinite(_flat(model)).all()
    assert not torch.equal(_flat(model), before)
    assert "targets=y" in SecondOrderOptimizer.__doc__


def test_hessian_accumulation_with_targets_equals_one_big_batch():
    x, y = _data(32)
    results = []
    for micro in (1, 2):
        model = _mlp()
        opt = _make("sso", model, "hessian", "full")
        for _ in range(2):
            opt.step(_closure(opt, model, x, y, micro=micro), targets=y)
        assert opt.num_skipped == 0
        results.append(_flat(model))
    assert torch.allclose(results[0], results[1], atol=1e-10, rtol=1e-9)
    assert (results[0] - _flat(_mlp())).abs().max() > 1e-4
