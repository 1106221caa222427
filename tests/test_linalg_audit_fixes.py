"""Linear-algebra defects found by an audit against torch.linalg (float64).

* damping 0 on a singular curvature: an eigenvalue that round-off made tiny and positive is a zero
  eigenvalue, and ``solve`` raises LinalgError as documented (it returned a vector of 1e18);
* ``Curvature.solve`` redoes its decomposition after a block's statistics changed in place;
* the low-rank path's probe accepts bfloat16 gradients (their own rounding is above 1e-3).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from curvature.linalg import LinalgError


def _singular_case(seed: int, approx: str):
    """A rank-deficient Fisher (7 examples, softmax over 3 classes: rank < P); its zero eigenvalues come
    out of eigh as round-off of either sign (the audit's case: silent on 21 of 40 seeds for K-FAC)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randint(0, 3, (7,))
    return curvature.compute(model, x, y, kind="fisher", approx=approx)


@pytest.mark.parametrize("approx", ["kfac", "full"])
def test_damping_zero_on_a_singular_curvature_raises(approx):
    raised = 0
    for seed in range(16):
        c = _singular_case(seed, approx)
        v = torch.randn(c.numel, dtype=torch.float64)
        try:
            x = c.solve(v, 0.0)
        except LinalgError as err:
            assert "increase damping" in str(err)
            raised += 1
            continue
        pytest.fail(f"seed {seed}: no error, |x| = {float(x.abs().max()):.1e}")  # it returned ~1e17 vectors
    assert raised == 16
    c = _singular_case(0, approx)  # any damping lifts the zero eigenvalues: a finite solve
    x = c.solve(torch.randn(c.numel, dtype=torch.float64), 1e-3)
    assert torch.isfinite(x).all()


def test_inverse_method_with_damping_zero_on_a_singular_factor_raises():
    c = _singular_case(0, "kfac")
    blk = c.blocks["2"]  # its G: cross-entropy output gradients sum to zero over the classes (singular)
    with pytest.raises(LinalgError, match="singular|positive definite"):
        blk.decompose(0.0, method="inverse")
    blk.decompose(1e-3, method="inverse")  # damped: fine


def test_solve_redoes_the_decomposition_after_the_statistics_change():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    c = curvature.compute(model, x, y, kind="fisher", approx="full")
    v = torch.randn(c.numel, dtype=torch.float64)
    c.solve(v, 0.1)
    for blk in c.blocks.values():  # in place, as an EMA would
        blk.matrix.mul_(3.0)
    expected = torch.linalg.solve(c.dense() + 0.1 * torch.eye(c.numel, dtype=torch.float64), v)
    torch.testing.assert_close(c.solve(v, 0.1), expected, rtol=1e-10, atol=1e-12)


def test_low_rank_probe_takes_bfloat16_gradients():
    from torchsso2 import SecondOrderOptimizer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10)).to(torch.bfloat16)
    x, y = torch.randn(4, 256, dtype=torch.bfloat16), torch.randint(0, 10, (4,))
    opt = SecondOrderOptimizer(model, lr=0.01)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        return loss, out
    for _ in range(3):
        opt.step(closure)
    assert opt.low_rank is not None and opt.low_rank.num_low_rank > 0 and opt.low_rank.num_rejected == 0
