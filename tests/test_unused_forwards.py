"""A forward in the closure whose output the loss does not use (pseudo-labels from the model with gradients
on, a metric) is left out of the step's curvature (torchsso2/optim/used_forwards.py): it was averaged in
as a micro-batch, weighted by its rows (22–26% off on this MLP), silently. Forwards the loss uses
(micro-batches, augmented views) still count."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from torchsso2 import SecondOrderOptimizer, VIOptimizer

DT = torch.float64


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 4, generator=g, dtype=DT), torch.randint(0, 3, (6,), generator=g)
    return x, y, torch.randn(10, 4, generator=g, dtype=DT)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _dense(opt) -> torch.Tensor:
    return torch.block_diag(*[b.dense() for b in opt.running.blocks.values()])


def _build(face: str, model: nn.Module, approx: str):
    if face == "sso":  # lr 0: the parameters stay where the reference takes the curvature
        return SecondOrderOptimizer(model, curvature="fisher", approx=approx, lr=0.0, kl_clip=None)
    # ema_decay 0 and a huge init precision: the running curvature is the batch's, at (almost) the mean
    return VIOptimizer(model, dataset_size=60, curvature="fisher", approx=approx, ema_decay=0.0, lr=0.0,
                       init_precision=1e14)


@pytest.mark.parametrize("face", ["sso", "vi"])
@pytest.mark.parametrize("approx", ["diag", "kfac", "full"])
def test_a_forward_the_loss_does_not_use_is_left_out(face, approx):
    x, y, xu = _data()
    model = _mlp()
    ref = curvature.compute(model, x, y, kind="fisher", approx=approx).dense()
    opt = _build(face, model, approx)

    def closure():
        opt.zero_grad()
        model(xu).argmax(-1)  # pseudo-labels with gradients on: not in the loss
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out
    opt.step(closure)
    tol = 1e-12 if face == "sso" else 1e-5
    assert torch.allclose(_dense(opt), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_forwards_the_loss_uses_still_count(face):
    """Two views whose losses are averaged, and accumulated micro-batches: the rows-weighted average."""
    x, y, xu = _data()
    both = torch.cat([x, xu[:6]])
    model = _mlp()
    ref = curvature.compute(model, both, torch.cat([y, y]), kind="fisher", approx="kfac").dense()
    for mode in ("views", "micro"):
        opt = _build(face, model, "kfac")

        def closure():
            opt.zero_grad()
            if mode == "views":
                loss = 0.5 * (F.cross_entropy(model(x), y) + F.cross_entropy(model(xu[:6]), y))
                loss.backward()
                return loss
            total = 0.0
            for xb in (x, xu[:6]):
                loss = 0.5 * F.cross_entropy(model(xb), y)
                loss.backward()
                total += float(loss.detach())
            return torch.tensor(total)
        opt.step(closure)
        tol = 1e-12 if face == "sso" else 1e-5
        assert torch.allclose(_dense(opt), ref, rtol=tol, atol=tol * float(ref.abs().max())), mode


def test_a_nonfinite_forward_the_loss_does_not_use_does_not_skip_the_step():
    x, y, xu = _data()
    model = _mlp()
    opt = SecondOrderOptimizer(model, curvature="fisher", lr=0.1)

    def closure():
        opt.zero_grad()
        model(xu * float("inf"))  # not finite, and not in the loss
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out
    opt.step(closure)
    assert opt.num_skipped == 0 and opt.num_steps == 1


def test_targets_with_an_unused_forward_name_no_grad():
    x, y, xu = _data()
    model = _mlp()
    opt = SecondOrderOptimizer(model, curvature="hessian", approx="diag", lr=0.1)

    def closure():
        opt.zero_grad()
        model(xu)
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out
    with pytest.raises(ValueError, match=r"pseudo-labels, a metric\) under torch\.no_grad\(\)"):
        opt.step(closure, targets=y)


def test_an_unused_forward_of_a_model_returning_a_dataclass_is_left_out():
    """Its output has no tensor leaves to hook: the selected output is hooked too."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _mlp()

        def forward(self, x):
            return Out(self.body(x))
    x, y, xu = _data()
    model = Net()
    select = lambda out: out.logits  # noqa: E731
    ref = curvature.compute(model, x, y, kind="fisher", approx="kfac", output_selector=select).dense()
    opt = SecondOrderOptimizer(model, curvature="fisher", lr=0.0, kl_clip=None, output_selector=select)

    def closure():
        opt.zero_grad()
        model(xu).logits.argmax(-1)
        out = model(x)
        loss = F.cross_entropy(out.logits, y)
        loss.backward()
        return loss, out
    opt.step(closure)
    assert torch.allclose(_dense(opt), ref, rtol=1e-12, atol=1e-12 * float(ref.abs().max()))
