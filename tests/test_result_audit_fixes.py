"""What curvature.compute returns, in cases an audit found wrong: a layer whose bias was registered
before its weight (the diagonal Fisher was permuted), a deep copy of a result edited in place, a
complex vector through the scipy operator, a vector of zero columns, the full-block memory warning
of a half-precision model."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import curvature
from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer


def _bias_first(layer: nn.Module) -> nn.Module:
    """The layer with its parameters registered as (bias, weight), as remove_parametrizations leaves it."""
    parametrizations.weight_norm(layer)
    parametrize.remove_parametrizations(layer, "weight")
    assert [n for n, _ in layer.named_parameters()] == ["bias", "weight"]
    return layer


@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher", "fisher_mc"])
@pytest.mark.parametrize("model_kind", ["mlp", "conv", "sequence"])
def test_diagonal_follows_the_parameter_order(kind: str, model_kind: str) -> None:
    torch.manual_seed(0)
    if model_kind == "conv":
        model = nn.Sequential(_bias_first(nn.Conv2d(2, 3, 3)), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)).double()
        x = torch.randn(6, 2, 4, 4, dtype=torch.float64)
    else:
        model = nn.Sequential(_bias_first(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 3)).double()
        x = torch.randn(6, 5, 3, dtype=torch.float64) if model_kind == "sequence" else torch.randn(6, 3, dtype=torch.float64)
    y = torch.randint(0, 3, x.shape[:2] if model_kind == "sequence" else (6,))
    kw = {"generator": torch.Generator().manual_seed(1)} if kind == "fisher_mc" else {}
    diag = curvature.compute(model, x, y, kind=kind, approx="diag", **kw)
    kw = {"generator": torch.Generator().manual_seed(1)} if kind == "fisher_mc" else {}
    full = curvature.compute(model, x, y, kind=kind, approx="full", **kw)
    assert diag.param_names[:2] == ["0.bias", "0.weight"]
    torch.testing.assert_close(torch.cat([d.reshape(-1) for d in diag.diagonal()]),
                               torch.cat([d.reshape(-1) for d in full.diagonal()]), rtol=1e-10, atol=1e-12)


def test_second_order_diagonal_with_the_bias_first() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_bias_first(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randint(0, 3, (16,))
    opt = SecondOrderOptimizer(model, approx="diag", curvature="fisher", lr=0.0, ema_decay=0.0)
    opt.step(make_closure(opt, model, x, y))
    full = curvature.compute(model, x, y, kind="fisher", approx="full")
    running = torch.cat([t.reshape(-1) for t in opt.running.blocks["0"].param_diagonal()])
    torch.testing.assert_close(running, torch.cat([d.reshape(-1) for d in full.diagonal()])[:16], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("approx", ["full", "kfac"])
def test_a_deep_copy_edited_in_place_is_decomposed_again(approx: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(30, 4, dtype=torch.float64), torch.randint(0, 3, (30,))
    c = curvature.compute(model, x, y, approx=approx)
    v = torch.randn(c.numel, dtype=torch.float64)
    c.blocks["0"].tensors()[0].mul_(1.0)  # an in-place op before the solve: version 1 -> 2
    c.solve(v, 0.1)
    c2 = copy.deepcopy(c)
    c2.blocks["0"].tensors()[0].mul_(2.0)  # the copy's counter restarts: this write would reach version 2
    want = torch.linalg.solve(c2.dense() + 0.1 * torch.eye(c2.numel, dtype=torch.float64), v)
    torch.testing.assert_close(c2.solve(v, 0.1), want, rtol=1e-9, atol=1e-10)


def test_scipy_operator_keeps_the_imaginary_part() -> None:
    np = pytest.importorskip("numpy")
    pytest.importorskip("scipy")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    c = curvature.compute(model, torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,)), approx="full")
    dense = c.dense().numpy()
    z = np.random.default_rng(0).standard_normal(c.numel) * (1 + 2j)
    op = c.to_scipy()
    np.testing.assert_allclose(op @ z, dense @ z, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(op.matmat(np.stack([z, z.conj()], 1)), dense @ np.stack([z, z.conj()], 1), atol=1e-14)


def test_a_vector_of_zero_columns() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    c = curvature.compute(model, torch.randn(8, 3), torch.randint(0, 2, (8,)), approx="diag")
    assert (c @ torch.zeros(c.numel, 0)).shape == (c.numel, 0)
    assert c.solve(torch.zeros(c.numel, 0), 0.1).shape == (c.numel, 0)


def test_full_block_warning_counts_the_stored_dtype(caplog) -> None:
    model = nn.Sequential(nn.Linear(50, 50)).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="curvature"):
        curvature.CurvatureEngine(model, kind="fisher", approx="full")
    assert "2550x2550 = 6,502,500 elements (25 MiB)" in caplog.text
