"""``output_selector``: models whose forward returns a tuple, dict or output object.

The curvature, the optimizer steps and VI's predictive are taken at the selected tensor; each
is compared with the same model returning that tensor directly (bit-exact: same seeds, same ops).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import curvature
from torchsso2 import SecondOrderOptimizer, VIOptimizer


def _plain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


class TupleOut(nn.Module):
    """``(logits, aux)``: the logits first, an auxiliary scalar second."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        out = self.net(x)
        return out, out.pow(2).mean()


class DictOut(TupleOut):
    def forward(self, x: Tensor) -> Any:  # type: ignore[override]
        out = self.net(x)
        return {"aux": out.sum(), "logits": out}


def _data() -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


CASES = [(TupleOut, lambda out: out[0]), (DictOut, lambda out: out["logits"])]


@pytest.mark.parametrize("wrapper, select", CASES, ids=["tuple", "dict"])
@pytest.mark.parametrize("kind, approx", [("fisher", "kfac"), ("fisher", "full"), ("fisher_mc", "diag"),
                                          ("empirical_fisher", "kfac"), ("hessian", "full")])
def test_compute_at_selected_output(wrapper, select, kind, approx) -> None:
    x, y = _data()
    plain = _plain()
    wrapped = wrapper(copy.deepcopy(plain))
    kw = dict(loss="cross_entropy", kind=kind, approx=approx)
    want = curvature.compute(plain, x, y, generator=torch.Generator().manual_seed(3), **kw)
    got = curvature.compute(wrapped, x, y, generator=torch.Generator().manual_seed(3), output_selector=select, **kw)
    assert torch.equal(got.dense(), want.dense())


def _closure(opt: Any, model: nn.Module, x: Tensor, y: Tensor, select: Callable[[Any], Tensor]):
    def closure():
        opt.zero_grad()
        out = select(model(x))
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out
    return closure


def _train_both(opt_cls: type, wrapper: type, select: Callable[[Any], Tensor], **kw: Any):
    """Three steps of ``opt_cls`` on the plain model and on ``wrapper`` around a copy of it (with
    ``output_selector=select``); asserts the weights stay bit-identical, returns both optimizers."""
    x, y = _data()
    plain = _plain()
    wrapped = wrapper(copy.deepcopy(plain))
    a, b = opt_cls(plain, **kw), opt_cls(wrapped, output_selector=select, **kw)
    for _ in range(3):
        a.step(_closure(a, plain, x, y, lambda o: o))
        b.step(_closure(b, wrapped, x, y, select))
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p, q)
    return a, b


@pytest.mark.parametrize("wrapper, select", CASES, ids=["tuple", "dict"])
@pytest.mark.parametrize("curv", ["fisher_mc", "empirical_fisher"])
def test_second_order_steps_match(wrapper, select, curv) -> None:
    _train_both(SecondOrderOptimizer, wrapper, select, lr=0.1, curvature=curv, approx="kfac", damping=1e-2, seed=0)


@pytest.mark.parametrize("wrapper, select", CASES, ids=["tuple", "dict"])
def test_vi_steps_and_predict_match(wrapper, select) -> None:
    a, b = _train_both(VIOptimizer, wrapper, select, dataset_size=50, lr=0.05, approx="diag",
                       prior_precision=1.0, seed=0)
    x, _ = _data()
    pa = a.predict(x, num_samples=4, generator=torch.Generator().manual_seed(5))
    pb = b.predict(x, num_samples=4, generator=torch.Generator().manual_seed(5))
    assert torch.equal(pa, pb)


def test_tuple_output_without_selector_is_a_clear_error() -> None:
    x, y = _data()
    model = TupleOut(_plain())
    with pytest.raises(TypeError, match=r"model returned tuple.*output_selector"):
        curvature.compute(model, x, y)
    opt = SecondOrderOptimizer(model, lr=0.1)
    with pytest.raises(TypeError, match=r"model returned tuple.*output_selector"):
        opt.step(_closure(opt, model, x, y, lambda o: o[0]))


def test_selector_errors() -> None:
    x, y = _data()
    model = DictOut(_plain())
    with pytest.raises(TypeError, match=r"output_selector returned str"):
        curvature.compute(model, x, y, output_selector=lambda out: "logits")
    with pytest.raises(TypeError, match=r"output_selector must be a callable"):
        SecondOrderOptimizer(model, lr=0.1, output_selector="logits")
