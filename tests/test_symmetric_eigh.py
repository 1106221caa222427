"""The K-FAC decomposition's lean path: ``Backend.eigh(a, symmetric=True)`` skips the ``(a + aᵀ)/2``
pass for factors symmetric by construction but keeps every safety check (non-finite input raises,
a failed or non-finite result is retried), and ``KFACBlock.decompose`` builds ``denom`` in place
with the same rounding as ``scale·λ_L λ_Rᵀ + damping``."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from curvature.blocks.kfac import KFACBlock
from curvature.linalg import LinalgError, get_backend
from curvature.linalg.eigh_retry import EighRetryWarning
from torchsso2 import SecondOrderOptimizer
from optim_helpers import make_closure

BACKENDS = ["torch", "numpy"]


def _gram(n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * n, n, generator=g, dtype=torch.float64)
    return (x.t() @ x / (3 * n)).to(dtype)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_symmetric_eigh_equals_the_symmetrized_one_to_rounding(name, dtype):
    a = _gram(9, dtype)
    a = a + 1e-7 * torch.triu(torch.ones_like(a), 1)  # the rounding of a Gram's two triangles
    w, q = get_backend(name).eigh(a, symmetric=True)
    w_ref, q_ref = torch.linalg.eigh(((a + a.mT) / 2).double())
    assert w.dtype == q.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-6
    assert torch.allclose(w.double(), w_ref, atol=tol)
    assert torch.allclose((q @ torch.diag(w) @ q.mT).double(), (a + a.mT).double() / 2, atol=tol)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_symmetric_eigh_still_refuses_a_non_finite_upper_triangle(name, bad):
    """The lower triangle alone is decomposed, so a NaN/Inf in the upper one would pass silently
    without the input's finite check."""
    a = _gram(6)
    a[1, 4] = bad
    with pytest.raises(LinalgError, match="non-finite"):
        get_backend(name).eigh(a, symmetric=True)


def test_the_result_check_retries_non_finite_eigenvectors_alone(monkeypatch):
    real = torch.linalg.eigh
    calls = []

    def eigh(a):
        calls.append(a.dtype)
        w, q = real(a)
        return (w, q * float("nan")) if a.dtype == torch.float32 else (w, q)
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    with pytest.warns(EighRetryWarning, match="recomputed in float64"):
        w, q = get_backend("torch").eigh(_gram(5), symmetric=True)
    assert calls == [torch.float32, torch.float64] and bool(torch.isfinite(q).all())


def test_a_finite_result_whose_sum_overflows_is_not_retried():
    a = torch.diag(torch.tensor([3e38, 3e38, 1.0], dtype=torch.float32))  # every sum overflows float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an EighRetryWarning would be an error
        w, _ = get_backend("torch").eigh(a, symmetric=True)
    assert torch.equal(w, torch.tensor([1.0, 3e38, 3e38]))


def _block() -> KFACBlock:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    opt = SecondOrderOptimizer(model, approx="kfac", lr=0.1, damping=0.1, seed=0)
    opt.step(make_closure(opt, model, x, y))
    blk = next(iter(opt.running.blocks.values()))
    return KFACBlock(blk.layout, blk.left.clone(), blk.right.clone())


@pytest.mark.parametrize("scale", [1.0, 3.7])
def test_eigen_denominator_is_scale_times_outer_plus_damping_bit_for_bit(scale):
    blk = _block()
    blk.decompose(0.03, scale=scale)
    (el, _), (er, _) = blk._factor_eigs(None, None)
    assert torch.equal(blk.decomposition["denom"], scale * torch.outer(el, er) + 0.03)
    assert bool((el >= 0).all()) and bool((er >= 0).all())  # clamped


def test_eigen_decomposition_matches_float64_brute_force():
    blk = _block()
    blk.decompose(0.03, scale=2.0)
    vecs = [torch.randn(s) for s in blk.layout.shapes]
    dense = 2.0 * blk.dense().double() + 0.03 * torch.eye(sum(v.numel() for v in vecs), dtype=torch.float64)
    ref = torch.linalg.solve(dense, torch.cat([v.reshape(-1).double() for v in vecs]))
    got = torch.cat([s.reshape(-1).double() for s in blk.solve(vecs)])
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("where", ["lower", "upper"])
def test_a_block_with_a_non_finite_factor_still_raises(where):
    blk = _block()
    i, j = (3, 1) if where == "lower" else (1, 3)
    blk.right[i, j] = float("nan")
    with pytest.raises(LinalgError, match="non-finite"):
        blk.decompose(0.1)
