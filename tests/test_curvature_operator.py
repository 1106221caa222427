"""Curvature as a linear operator: diagonal(), matvec/@, solve(), to_scipy() and dense()'s size guard,
checked against the dense matrix on tiny float64 models (Linear, Conv2d, norm layers, Embedding)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import curvature
from curvature.result import DENSE_MAX_ELEMENTS
from tests.models import MODELS

CASES = [(m, a) for m in ("mlp", "cnn", "norm_mlp", "norm_cnn", "embedding") for a in ("full", "diag", "kfac")]


def _curv(model_name: str, approx: str, kind: str = "fisher") -> curvature.Curvature:
    build, batch = MODELS[model_name]
    model = build()
    x, y = batch(6, "cross_entropy")
    return curvature.compute(model, x, y, kind=kind, approx=approx)


def _flat(parts):
    return torch.cat([p.reshape(-1) for p in parts])


@pytest.mark.parametrize("model_name,approx", CASES)
def test_diagonal_matches_dense_diagonal(model_name: str, approx: str) -> None:
    c = _curv(model_name, approx)
    diag = c.diagonal()
    assert [d.shape for d in diag] == [p.shape for p in c.params]
    torch.testing.assert_close(_flat(diag), c.dense().diagonal(), rtol=1e-10, atol=1e-12)
    assert len(c.param_names) == len(c.params)


def test_kfac_diagonal_with_bias_column_by_hand() -> None:
    """Linear with bias: diag(G) ⊗ diag(A) where A's last entry is the bias's (E[1·1] = 1)."""
    c = _curv("mlp", "kfac")
    blk = c.blocks["fc1"]
    w, b = blk.param_diagonal()
    dg, da = blk.G.diagonal(), blk.A.diagonal()
    torch.testing.assert_close(w, torch.outer(dg, da[:-1]))
    torch.testing.assert_close(b, dg * da[-1])


@pytest.mark.parametrize("model_name,approx", CASES)
def test_matvec_and_solve_match_dense(model_name: str, approx: str) -> None:
    c = _curv(model_name, approx)
    dense = c.dense()
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(c.numel, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(c.matvec(v), dense @ v)
    torch.testing.assert_close(c @ v, dense @ v)
    # per-parameter form comes back per parameter
    parts = c.matvec([t.clone() for t in _split(c, v)])
    torch.testing.assert_close(_flat(parts), dense @ v)
    # several columns at once
    m = torch.randn(c.numel, 3, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(c @ m, dense @ m)
    damping = 0.1
    expected = torch.linalg.solve(dense + damping * torch.eye(c.numel, dtype=dense.dtype), v)
    torch.testing.assert_close(c.solve(v, damping), expected)
    torch.testing.assert_close(_flat(c.solve(_split(c, v), damping)), expected)
    # another damping re-decomposes
    expected2 = torch.linalg.solve(dense + 2.0 * torch.eye(c.numel, dtype=dense.dtype), v)
    torch.testing.assert_close(c.solve(v, 2.0), expected2)


def _split(c: curvature.Curvature, v: torch.Tensor):
    out, i = [], 0
    for p in c.params:
        out.append(v[i:i + p.numel()].reshape(p.shape))
        i += p.numel()
    return out


@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
def test_scipy_eigsh_top_eigenvalue(approx: str) -> None:
    from scipy.sparse.linalg import LinearOperator, eigsh

    c = _curv("norm_cnn", approx)
    op = c.to_scipy()
    assert isinstance(op, LinearOperator) and op.shape == (c.numel, c.numel) and op.dtype == np.float64
    x = np.random.default_rng(0).standard_normal(c.numel)
    np.testing.assert_allclose(op.matvec(x), (c.dense() @ torch.from_numpy(x)).numpy(), rtol=1e-10, atol=1e-12)
    top = eigsh(op, k=1, which="LA", return_eigenvectors=False)[0]
    assert top == pytest.approx(float(torch.linalg.eigvalsh(c.dense())[-1]), rel=1e-8)
    assert c.as_linear_operator().shape == op.shape


def test_bad_vectors_are_rejected() -> None:
    c = _curv("mlp", "kfac")
    with pytest.raises(ValueError, match=rf"\[{c.numel}\]"):
        c.matvec(torch.zeros(c.numel + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="covered parameters"):
        c.matvec([torch.zeros(3)])
    with pytest.raises(ValueError, match="damping"):
        c.solve(torch.zeros(c.numel, dtype=torch.float64), -1.0)


def test_dense_refuses_huge_matrix_and_states_the_size() -> None:
    """An 85k-parameter MLP would need a 29 GB dense matrix: refused before allocating."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 64), nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(4, 784), torch.randint(0, 10, (4,))
    c = curvature.compute(model, x, y, approx="kfac")
    assert c.numel ** 2 > DENSE_MAX_ELEMENTS
    with pytest.raises(ValueError, match=rf"\[{c.numel}, {c.numel}\].*GiB.*max_elements=None"):
        c.dense()
    # the operator faces work on it all the same
    assert [d.shape for d in c.diagonal()] == [p.shape for p in c.params]
    assert c.matvec(torch.ones(c.numel)).shape == (c.numel,)
    # the override: a small model under a tiny limit refuses, and None lifts the limit
    small = _curv("mlp", "diag")
    with pytest.raises(ValueError, match="max_elements=10"):
        small.dense(max_elements=10)
    assert small.dense(max_elements=None).shape == small.shape
