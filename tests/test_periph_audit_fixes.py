"""Findings of an audit of the less-used modules: ``to_scipy`` on strided / read-only NumPy arrays,
NumPy scalars as numbers, and reliability bins of low-precision confidences."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import curvature
from torchsso2 import metrics
from torchsso2.distributed.faults import resolve_timeout


def test_to_scipy_takes_negative_strides_and_read_only_arrays() -> None:
    """x[::-1], np.flip and np.frombuffer (negative strides, read-only) give D @ x (torch refused the
    negative strides and warned on every read-only call)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    c = curvature.compute(model, x, y, kind="fisher", approx="kfac")
    dense = c.dense().numpy()
    op = c.to_scipy()
    v = np.random.default_rng(0).standard_normal(dense.shape[0])
    m = np.random.default_rng(1).standard_normal((dense.shape[0], 3))
    np.testing.assert_allclose(op.matvec(v[::-1]), dense @ v[::-1], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(op @ np.flip(m, 1), dense @ np.flip(m, 1), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(op.matmat(m[::-1]), dense @ m[::-1], rtol=1e-12, atol=1e-14)
    frozen = np.frombuffer(v.tobytes(), dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(op.matvec(frozen), dense @ v, rtol=1e-12, atol=1e-14)


def test_numpy_scalars_are_numbers() -> None:
    """A NumPy scalar timeout / eps is its value (both were refused with a message stating they are
    what was expected); bool stays refused."""
    assert resolve_timeout(np.int64(30)) == 30.0 and resolve_timeout(np.float32(30.0)) == 30.0
    with pytest.raises(ValueError, match="timeout"):
        resolve_timeout(True)
    probs, targets = torch.tensor([[0.9, 0.1]]), torch.tensor([0])
    want = metrics.nll(probs, targets, eps=1e-12)
    assert metrics.nll(probs, targets, eps=np.float32(1e-12)) == pytest.approx(want)
    assert metrics.nll(probs, targets, eps=torch.tensor(1e-12)) == pytest.approx(want)
    with pytest.raises(TypeError, match="eps"):
        metrics.nll(probs, targets, eps=True)


def test_reliability_bins_of_low_precision_confidences() -> None:
    """bfloat16 confidence 255/256 with 1000 bins: the edges 0.995..0.998 all round to it, so it goes to
    float64's bin 996 = (0.996, 0.997] (it went to bin 994, above that bin's upper edge); an edge equal
    in its own dtype still goes to the bin it closes (float32(0.1) in (0, 0.1])."""
    probs = torch.tensor([[0.99609375, 0.00390625]], dtype=torch.bfloat16)
    data = metrics.reliability_diagram_data(probs, torch.tensor([0]), n_bins=1000)
    assert int(data.bin_count.argmax()) == 996
    edge = torch.tensor([[0.1, 0.9]], dtype=torch.float32)
    assert int(metrics.reliability_diagram_data(edge, torch.tensor([1]), n_bins=10).bin_count.argmax()) == 8
    assert int(metrics.reliability_diagram_data(torch.tensor([[0.9, 0.1]]), torch.tensor([0]),
                                                n_bins=10).bin_count.argmax()) == 8
