"""curvature.compute's result API on inputs an audit found mishandled: integer/bool/complex vectors
(cast, values lost), a solve after a block was decomposed at another damping (the stale one reused),
numpy vectors and transposed matrices (unclear errors), NumPy / 0-dim tensor damping, an empty
batch and list targets."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import curvature


@pytest.fixture
def curv():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    return curvature.compute(model, x, y, kind="fisher", approx="kfac")


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.complex128])
def test_non_real_vectors_are_refused(curv, dtype) -> None:
    v = torch.ones(curv.numel, dtype=dtype)
    with pytest.raises(TypeError, match=f"dtype {dtype}"):
        curv @ v
    with pytest.raises(TypeError, match="real floating-point"):
        curv.solve(v, 0.1)


def test_solve_redecomposes_a_block_decomposed_elsewhere(curv) -> None:
    v = torch.randn(curv.numel, dtype=torch.float64)
    want = torch.linalg.solve(curv.dense() + 0.1 * torch.eye(curv.numel, dtype=torch.float64), v)
    torch.testing.assert_close(curv.solve(v, 0.1), want)
    curv.blocks["0"].decompose(5.0)  # the public block API, at another damping
    torch.testing.assert_close(curv.solve(v, 0.1), want)


def test_unclear_inputs_get_named(curv) -> None:
    with pytest.raises(TypeError, match="got ndarray"):
        curv @ np.ones(curv.numel)
    with pytest.raises(ValueError, match=f"got \\(2, {curv.numel}\\)"):
        curv @ torch.ones(2, curv.numel, dtype=torch.float64)
    v = torch.randn(curv.numel, dtype=torch.float64)
    for damping in (np.float32(0.1), torch.tensor(0.1, dtype=torch.float64)):
        torch.testing.assert_close(curv.solve(v, damping), curv.solve(v, 0.1), rtol=1e-6, atol=1e-9)
    with pytest.raises(TypeError, match="damping must be a real number"):
        curv.solve(v, "0.1")


def test_compute_names_an_empty_batch_and_list_targets() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="empty batch"):
        curvature.compute(model, torch.randn(0, 4), torch.zeros(0, dtype=torch.long))
    with pytest.raises(TypeError, match="targets must be a Tensor"):
        curvature.compute(model, torch.randn(2, 4), [0, 1])
