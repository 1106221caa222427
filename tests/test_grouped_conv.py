"""Grouped convolutions (``groups > 1``: depthwise, ResNeXt-style): diagonal and full blocks, a K-FAC request
gives them the diagonal (curvature/modules/grouped_conv.py).

Every kind × shape is checked against the brute-force reference in ``test_curvature_reference.py``
(``tests/models.py``'s ``grouped``: a depthwise Conv2d, a Conv2d of 2 groups, a Conv1d of 3 groups without bias).
Here: the chunked diagonal sums, which shape each way of asking gets, KFACPreconditioner's refusal, and training.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from curvature.modules import grouped_conv
from optim_helpers import make_closure
from reference import Reference
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner


def _block(depthwise_bias: bool = True) -> nn.Module:
    """A MobileNet block: depthwise 3×3 → BatchNorm → ReLU → pointwise 1×1 → pool → Linear."""
    return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=depthwise_bias), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 8, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


def test_the_diagonal_sums_in_chunks_equal_the_per_example_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(6, 4, 2, groups=2), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 8, 3)).double().eval()
    x, y = torch.randn(5, 6, 3, 3, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    want = Reference(model, x, y, "cross_entropy").shaped("empirical_fisher", "diag")
    monkeypatch.setattr(grouped_conv, "CHUNK_ELEMENTS", 1)  # one example a chunk
    got = curvature.compute(model, x, y, kind="empirical_fisher", approx="diag").dense()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_each_way_of_asking_for_kfac(caplog: pytest.LogCaptureFixture) -> None:
    """The defaults, a plain approx='kfac' and a layer-type key give a grouped convolution the diagonal (logged
    once, with the reason); a key naming the module asks for what is not defined: a ValueError naming it."""
    model = _block()
    with caplog.at_level(logging.INFO, logger="curvature"):
        opt = SecondOrderOptimizer(model)
    assert {n: a.value for n, a in opt.engine.approx.items()} == {"0": "diag", "1": "diag", "3": "kfac", "7": "kfac"}
    assert "K-FAC is not defined for these modules, which take approx='diag': grouped convolutions '0' (Conv2d, " \
        "groups=4); 1 layer of types without K-FAC (BatchNorm2d)" in caplog.text  # one line, at construction
    for approx in ("kfac", {nn.Conv2d: "kfac", nn.Linear: "diag"}, {"Conv2d": "kfac"}):
        c = SecondOrderOptimizer(_block(), approx=approx)
        assert c.engine.approx["0"].value == "diag" and c.engine.approx["3"].value == "kfac"
    with pytest.raises(ValueError, match=r"approx='kfac' was asked for module '0' \(key '\^0\$'\) but K-FAC is not "
                                         r"defined for a Conv2d with groups=4 .*\{Conv2d: 'kfac'\}"):
        SecondOrderOptimizer(_block(), approx={"^0$": "kfac"})
    full = SecondOrderOptimizer(_block(), approx={"^0$": "full"})
    assert full.engine.approx["0"].value == "full"


def test_kfac_preconditioner_refuses_a_grouped_conv_by_name() -> None:
    """kfac_pytorch registers it and fails at its first step (the factors' sizes do not match the weight)."""
    with pytest.raises(ValueError, match=r"module '0': K-FAC is not defined for a Conv2d with groups=4 .* add it to "
                                         r"skip_layers"):
        KFACPreconditioner(_block())
    pre = KFACPreconditioner(_block(), skip_layers=["0"])
    assert sorted(pre.layers) == ["3", "7"]


def _task(n: int = 96):
    """Which of three 6×6 stripe patterns (rows, columns, diagonal) a noisy 4-channel image holds."""
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (n,), generator=gen)
    x = 0.5 * torch.randn(n, 4, 6, 6, generator=gen)
    pattern = torch.zeros(3, 6, 6)
    pattern[0, ::2] = 1.0
    pattern[1, :, ::2] = 1.0
    pattern[2] = torch.eye(6)
    x += pattern[y].unsqueeze(1)
    return x, y


@pytest.mark.parametrize("face", ["second_order", "second_order_full", "vi_diag", "vi_kfac"])
def test_the_optimizers_train_a_depthwise_block(face: str) -> None:
    torch.manual_seed(0)
    x, y = _task()
    model = _block()
    with torch.no_grad():
        first = float(F.cross_entropy(model.eval()(x), y))
    model.train()
    opt = {"second_order": lambda: SecondOrderOptimizer(model, lr=0.1),
           "second_order_full": lambda: SecondOrderOptimizer(model, lr=0.1, approx={"^0$": "full"}),
           "vi_diag": lambda: VIOptimizer(model, dataset_size=96, lr=0.1),
           "vi_kfac": lambda: VIOptimizer(model, dataset_size=96, approx="kfac", lr=0.1)}[face]()
    closure = make_closure(opt, model, x, y)
    for _ in range(40):  # (VI: SecondOrderOptimizer gets there in 20)
        opt.step(closure)
    with torch.no_grad():
        assert float(F.cross_entropy(model.eval()(x), y)) < 0.5 * first
    assert opt.num_skipped == 0


def test_a_grouped_conv_sharing_an_ordinary_convs_weight(caplog: pytest.LogCaptureFixture) -> None:
    """The ordinary conv owns the block, the grouped one is a tied use: by default its K-FAC is not defined
    either, so it takes the diagonal (exact: the summed per-example gradients); asked by name, the tied check
    names the grouped use as the cause."""
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(4, 4, 3, bias=False)
            self.b = nn.Conv2d(8, 4, 3, groups=2, bias=False)
            self.b.weight = self.a.weight
            self.fc = nn.Linear(2 * 64, 3)

        def forward(self, x):  # [N, 4, 6, 6]
            return self.fc(torch.cat([self.a(x).flatten(1), self.b(torch.cat([x, x], 1)).flatten(1)], 1))

    torch.manual_seed(0)
    model = Shared().double().eval()
    x, y = torch.randn(3, 4, 6, 6, dtype=torch.float64), torch.tensor([0, 1, 2])
    with caplog.at_level(logging.INFO, logger="curvature"):
        opt = SecondOrderOptimizer(model)
    assert opt.engine.approx["a"].value == "diag" and opt.engine.approx["fc"].value == "kfac"
    assert "'a' (Conv2d: a use of its tied parameter has none ('b': K-FAC is not defined for a Conv2d with groups=2" \
        in caplog.text
    got = curvature.compute(model, x, y, kind="fisher", approx="kfac").blocks["a"].dense()
    n = model.a.weight.numel()
    want = Reference(model, x, y, "cross_entropy").shaped("fisher", "diag")[:n, :n]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(NotImplementedError, match=r"K-FAC of module 'a' \(Conv2d\).* is not defined: a use of its tied "
                                                  r"parameter has none \('b': K-FAC is not defined for a Conv2d"):
        curvature.compute(model, x, y, kind="fisher", approx={"^a$": "kfac", "fc": "kfac"})


def test_keys_by_class_name_fall_back_regexes_name_the_way_out(caplog: pytest.LogCaptureFixture) -> None:
    class MyConv(nn.Conv2d):
        pass

    def model() -> nn.Module:
        return nn.Sequential(MyConv(4, 4, 3, padding=1, groups=4), nn.ReLU(), MyConv(4, 8, 1), nn.Flatten(),
                             nn.Linear(8 * 16, 3))

    for key in (MyConv, "MyConv"):  # the layer type, as a type or by its class name
        opt = SecondOrderOptimizer(model(), approx={key: "kfac"})
        assert opt.engine.approx["0"].value == "diag" and opt.engine.approx["2"].value == "kfac"
    with pytest.raises(ValueError, match=r"module '0' \(key '\^\[02\]\$'\) but K-FAC is not defined .* or ask K-FAC by "
                                         r"layer type"):
        SecondOrderOptimizer(model(), approx={"^[02]$": "kfac"})
    deep = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=g), nn.ReLU()) for g in (4, 2, 4, 2)],
                         nn.Flatten(), nn.Linear(4 * 16, 3))
    with caplog.at_level(logging.INFO, logger="curvature"):
        SecondOrderOptimizer(deep)
    lines = [r.getMessage() for r in caplog.records if "take approx='diag'" in r.getMessage()]
    assert lines == ["K-FAC is not defined for these modules, which take approx='diag': grouped convolutions '0.0' "
                     "(Conv2d, groups=4), '1.0' (Conv2d, groups=2), '2.0' (Conv2d, groups=4), '3.0' (Conv2d, groups=2)"]
