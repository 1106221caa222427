"""Loss conventions: one-logit outputs, the closure's loss scale in adaptive mode, auxiliary logit terms."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from torchsso2 import SecondOrderOptimizer, VIOptimizer


def _binary() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16, 1)).float()
    return model, x, y


@pytest.mark.parametrize("kind", ["fisher", "fisher_mc"])
def test_one_logit_cross_entropy_is_refused_not_zero_curvature(kind: str) -> None:
    model, x, _ = _binary()
    with pytest.raises(ValueError, match=r"one class.*loss='binary_cross_entropy'.*loss='mse'"):
        curvature.compute(model, x, torch.zeros(16, dtype=torch.long), kind=kind)
    opt = SecondOrderOptimizer(model, curvature=kind)

    def closure() -> tuple:
        opt.zero_grad()
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        return loss, out
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="one class"):
        opt.step(closure)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _bce_closure(opt, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """A binary classifier's closure: one logit, F.binary_cross_entropy_with_logits."""
    def closure() -> tuple:
        opt.zero_grad()
        out = model(x)
        loss = F.binary_cross_entropy_with_logits(out, y)
        loss.backward()
        return loss, out
    return closure


def test_one_logit_empirical_fisher_from_the_backward_still_trains() -> None:
    model, x, y = _binary()
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher")
    closure = _bce_closure(opt, model, x, y)
    first = float(closure()[0].detach())
    for _ in range(20):
        opt.step(closure)
    assert float(closure()[0].detach()) < first


def test_vi_predict_refuses_a_one_logit_softmax() -> None:
    """(The first step refuses it already: tests/test_binary_cross_entropy.py.)"""
    model, x, y = _binary()
    opt = VIOptimizer(model, dataset_size=16)
    with pytest.raises(ValueError, match=r"one logit is 1 everywhere.*use loss='binary_cross_entropy'"):
        opt.predict(x)


def test_one_logit_empirical_fisher_from_the_backward_trains_between_curvature_steps() -> None:
    """The output's shape is checked at the steps between curvature estimates only where its likelihood is read."""
    model, x, y = _binary()
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher", curv_update_interval=3)
    closure = _bce_closure(opt, model, x, y)
    first = float(closure()[0].detach())
    for _ in range(6):
        opt.step(closure)
    assert float(closure()[0].detach()) < first


def _regression() -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g, dtype=torch.float64)
    y = torch.randn(64, 3, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    return nn.Linear(5, 3).double(), x, y


def _adaptive_regression(scaled: bool) -> tuple:
    """An adaptive-lr optimizer on a linear mse model and its closure (``F.mse_loss`` when ``scaled``)."""
    model, x, y = _regression()
    opt = SecondOrderOptimizer(model, loss="mse", curvature="fisher", approx="full", damping=1e-8,
                               use_adaptive_learning_rate=True)

    def closure() -> tuple:
        opt.zero_grad()
        out = model(x)
        loss = F.mse_loss(out, y) if scaled else 0.5 * (out - y).pow(2).sum(-1).mean()
        loss.backward()
        return loss, out
    return model, opt, closure, x, y


@pytest.mark.parametrize("scaled", [False, True])
def test_adaptive_mode_warns_when_the_closures_loss_is_not_the_mean_nll(scaled: bool) -> None:
    model, opt, closure, x, y = _adaptive_regression(scaled)
    with torch.no_grad():
        aug = torch.cat([x, torch.ones(64, 1, dtype=x.dtype)], 1)
        solution = torch.linalg.lstsq(aug, y).solution  # [6, 3]
    start = torch.cat([model.weight.detach().T, model.bias.detach()[None]]).clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step(closure, targets=y)
        first = torch.cat([model.weight.detach().T, model.bias.detach()[None]]).clone()
        opt.step(closure, targets=y)  # once per optimizer
    mine = [w for w in caught if "mean negative log-likelihood" in str(w.message)]
    assert len(mine) == (1 if scaled else 0)
    if scaled:
        assert "0.6667×" in str(mine[0].message)  # F.mse_loss = (2/D)·mean NLL, D = 3
    # the first step goes 2/D of the way to the least-squares solution with the scaled loss, all of it without
    fraction = float((first - start).norm() / (solution - start).norm())
    assert fraction == pytest.approx(2 / 3 if scaled else 1.0, rel=1e-4)


def test_an_auxiliary_logit_term_gets_a_warning_that_does_not_only_advise_mse() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    opt = SecondOrderOptimizer(model, lr=0.1, curvature="fisher", approx="full")

    def closure() -> tuple:
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y) + 0.1 * out.pow(2).mean()  # a logit penalty
        loss.backward()
        return loss, out
    with pytest.warns(UserWarning, match=r"auxiliary term on the logits.*the step is right"):
        opt.step(closure)


class _DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        features = torch.tanh(self.body(x))
        return {"logits": self.head(features), "features": features}


@pytest.mark.parametrize("returns", ["model output", "selected output"])
@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_the_loss_check_reads_a_returned_dict_and_an_already_selected_output(returns: str, scale: float) -> None:
    """With ``output_selector=lambda o: o["logits"]`` a closure may return the model's dict or the logits it
    picked: the first step's comparison of the loss with the mean NLL reads either (a 2× loss is warned about,
    the NLL itself is not), and applying the selector to the logits (a tensor indexed by a string, which torch
    warns about before it raises) leaves no warning behind."""
    torch.manual_seed(0)
    model = _DictModel()
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher", output_selector=lambda o: o["logits"])

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = scale * F.cross_entropy(out["logits"], y)
        loss.backward()
        return loss, (out if returns == "model output" else out["logits"])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step(closure, targets=y)
    texts = [str(w.message) for w in caught]
    assert not any("non-tuple sequence" in t for t in texts), texts
    assert any("not the mean NLL" in t or "mean negative log-likelihood" in t for t in texts) is (scale != 1.0), texts
