"""Hugging Face accelerate's gradient accumulation, recognised without accelerate installed: a fake
``accelerate.state`` module stands in for it (its ``GradientState`` singleton, as accelerate 1.x has it).

Under ``Accelerator(gradient_accumulation_steps=k)`` the wrapper skips ``step()`` (and so the closure)
on k − 1 of every k batches: SecondOrderOptimizer and VIOptimizer trained on one batch in k, silently.
A KFACPreconditioner stepped on every micro-batch preconditioned partial gradients (67% off).
"""
from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner


def _fake_accelerate(monkeypatch: pytest.MonkeyPatch, num_steps: int, sync: bool) -> None:
    class GradientState:
        _shared_state = {"initialized": True}

        def __init__(self) -> None:
            self.num_steps = num_steps
            self.sync_gradients = sync
    state = types.ModuleType("accelerate.state")
    state.GradientState = GradientState  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "accelerate.state", state)


def _accelerated_step(monkeypatch: pytest.MonkeyPatch):
    """A stand-in for ``AcceleratedOptimizer.step``: a function of a module named ``accelerate.optimizer``."""
    module = types.ModuleType("accelerate.optimizer")
    exec("def step(opt, closure):\n    return opt.step(closure)\n", module.__dict__)
    monkeypatch.setitem(sys.modules, "accelerate.optimizer", module)
    return module.step


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    return model, torch.randn(8, 4), torch.randint(0, 3, (8,))


@pytest.mark.parametrize("face", ["second_order", "vi"])
def test_accelerates_gradient_accumulation_is_named_at_the_first_step(face: str, monkeypatch) -> None:
    model, x, y = _setup()
    opt = SecondOrderOptimizer(model, lr=0.05) if face == "second_order" else VIOptimizer(model, dataset_size=8)
    _fake_accelerate(monkeypatch, num_steps=4, sync=True)
    accelerated = _accelerated_step(monkeypatch)
    with pytest.warns(UserWarning, match=r"gradient_accumulation_steps=4\): inside accelerator.accumulate\(\), "
                                         r"accelerate skips step\(\) on 3 of every 4 batches"):
        accelerated(opt, make_closure(opt, model, x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        accelerated(opt, make_closure(opt, model, x, y))


def test_no_warning_without_accumulation_or_without_an_accelerator(monkeypatch) -> None:
    model, x, y = _setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = SecondOrderOptimizer(model, lr=0.05)
        opt.step(make_closure(opt, model, x, y))  # accelerate not imported (or no Accelerator made)
        _fake_accelerate(monkeypatch, num_steps=1, sync=True)
        accelerated = _accelerated_step(monkeypatch)
        opt2 = SecondOrderOptimizer(model, lr=0.05)
        accelerated(opt2, make_closure(opt2, model, x, y))
        # an Accelerator accumulating for another model: this optimizer's plain loop is not named
        _fake_accelerate(monkeypatch, num_steps=4, sync=True)
        opt3 = SecondOrderOptimizer(model, lr=0.05)
        opt3.step(make_closure(opt3, model, x, y))


def test_a_preconditioner_step_on_a_micro_batch_accelerate_does_not_step_on_is_named(monkeypatch) -> None:
    model, x, y = _setup()
    pre = KFACPreconditioner(model)
    _fake_accelerate(monkeypatch, num_steps=2, sync=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sync step: the guarded loop
        F.cross_entropy(model(x), y).backward()
        pre.step()
    _fake_accelerate(monkeypatch, num_steps=1, sync=False)  # stale: a loop stopped mid-accumulation, then a new
    with warnings.catch_warnings():                        # Accelerator without accumulation
        warnings.simplefilter("error")
        F.cross_entropy(model(x), y).backward()
        pre.step()
    _fake_accelerate(monkeypatch, num_steps=2, sync=False)
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(UserWarning, match=r"if accelerator.sync_gradients: precond.step\(\)"):
        pre.step()


def test_a_scalar_model_output_is_named_as_a_likely_loss() -> None:
    """A Hugging Face model called with labels= returns the loss first: out[0] selected the loss, and the
    error said "empty batch"."""
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 3)

        def forward(self, x, y):
            logits = self.net(x)
            return F.cross_entropy(logits, y), logits

    torch.manual_seed(0)
    model = WithLoss()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    opt = SecondOrderOptimizer(model, lr=0.05, output_selector=lambda out: out[0])

    def closure():
        opt.zero_grad()
        loss, _ = model(x, y)
        loss.backward()
        return loss
    with pytest.raises(ValueError, match=r"is a scalar, not a batch .*squeeze\(-1\).*out\[.logits.\], not out\[0\]"):
        opt.step(closure)
