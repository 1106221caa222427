"""The curvature result's edges: a full block's dense() is a copy (it was the statistics themselves: an
in-place edit changed the curvature), a block decomposition checks its damping (NaN was a misleading
LinalgError, a string torch's TypeError), a damping tensor of several values is named, and to_scipy() moves
its vectors to the curvature's device (it built them on the CPU only)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import curvature


def _result(approx: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    return curvature.compute(model, x, y, approx=approx)


@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
def test_block_dense_is_a_copy(approx):
    c = _result(approx)
    before = c.dense()
    c.blocks["0"].dense().mul_(0)
    assert torch.equal(c.dense(), before)


@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
@pytest.mark.parametrize("damping,error", [("a", TypeError), (float("nan"), ValueError), (-1.0, ValueError),
                                           (None, TypeError)])
def test_block_decompose_checks_its_damping(approx, damping, error):
    with pytest.raises(error, match="damping must be a"):
        _result(approx).blocks["0"].decompose(damping)


def test_solve_names_a_damping_tensor_of_several_values():
    c = _result("full")
    with pytest.raises(TypeError, match=r"one-element real tensor, got a tensor of shape \(2,\)"):
        c.solve(torch.ones(c.numel, dtype=torch.float64), torch.tensor([1.0, 2.0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (to_scipy on a GPU result)")
@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
def test_to_scipy_on_a_cuda_result(approx):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double().cuda()
    x, y = torch.randn(6, 4, dtype=torch.float64).cuda(), torch.randint(0, 3, (6,)).cuda()
    c = curvature.compute(model, x, y, approx=approx)
    v = np.random.default_rng(0).standard_normal(c.numel)
    expected = (c.dense().cpu() @ torch.from_numpy(v)).numpy()
    assert np.allclose(c.to_scipy().matvec(v), expected, rtol=1e-10, atol=1e-12)
