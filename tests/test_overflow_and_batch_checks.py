"""Values beyond the float range and mismatched batch dims get clear errors (they raised OverflowError,
RuntimeError, returned inf or blamed the curvature): an int hyperparameter above the largest float
(10**400) is a ValueError naming it, an int weight decay above int64 (10**30) is applied as a float;
KFACPreconditioner takes a step count of any size as an int; the linalg backends refuse batch dims
that do not broadcast; ``Curvature.solve`` refuses a damping beyond its dtype's largest value, and the
optimizers' failed-decomposition warning names that cause; an eigendecomposition whose float64
retry has eigenvalues beyond float32 raises instead of returning inf."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

import curvature
import torchsso2
from curvature.linalg import LinalgError, get_backend
from optim_helpers import make_closure


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("key", ["lr", "damping", "momentum", "weight_decay"])
def test_int_beyond_the_float_range_is_a_value_error(key: str) -> None:
    with pytest.raises(ValueError, match=f"{key}=1000.*beyond the largest float"):
        torchsso2.SecondOrderOptimizer(_model(), **{key: 10 ** 400})
    if key != "weight_decay":
        with pytest.raises(ValueError, match=f"{key}=1000.*beyond the largest float"):
            torchsso2.VIOptimizer(_model(), dataset_size=10, **{key: 10 ** 400})


def test_int_weight_decay_beyond_int64_is_applied() -> None:
    m = _model()
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    opt = torchsso2.SecondOrderOptimizer(m, lr=1e-30, weight_decay=10 ** 30, approx="diag")
    before = [p.detach().clone() for p in m.parameters()]
    opt.step(make_closure(opt, m, x, y))  # raised OverflowError (int too big to convert) in g + wd·θ
    assert opt.num_skipped == 0
    assert any(not torch.equal(b, p) for b, p in zip(before, m.parameters()))
    assert all(bool(torch.isfinite(p).all()) for p in m.parameters())


@pytest.mark.parametrize("key", ["damping", "lr", "kl_clip", "factor_decay"])
def test_kfac_float_hyperparameters_beyond_the_float_range(key: str) -> None:
    with pytest.raises(ValueError, match=f"{key} must be"):
        torchsso2.KFACPreconditioner(_model(), **{key: 10 ** 400})


def test_kfac_step_counts_of_any_size_are_ints() -> None:
    precon = torchsso2.KFACPreconditioner(_model(), factor_update_steps=10 ** 400, inv_update_steps=10 ** 400)
    assert precon.factor_update_steps == 10 ** 400
    with pytest.raises(TypeError, match="factor_update_steps must be an int"):
        torchsso2.KFACPreconditioner(_model(), factor_update_steps=float("inf"))


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_batch_dims_that_do_not_broadcast(backend: str) -> None:
    b = get_backend(backend)
    a = torch.eye(4).expand(2, 4, 4).clone()
    with pytest.raises(ValueError, match=r"solve: the inputs' batch dims do not broadcast together \(a \[2\], rhs \[3\]\)"):
        b.solve(a, torch.ones(3, 4, 1))
    with pytest.raises(ValueError, match=r"kron_eigen_solve: .*g_evals \[2\].*a_evals \[5\]"):
        b.kron_eigen_solve(torch.ones(2, 3), torch.eye(3).expand(2, 3, 3), torch.ones(5, 4),
                           torch.eye(4).expand(5, 4, 4), torch.ones(3, 4), 0.1)
    # broadcasting batches still work: [2, 4, 4] with a vector [4] and with [1, 4, 1]
    assert b.solve(a, torch.ones(4)).shape == (2, 4) and b.solve(a, torch.ones(1, 4, 1)).shape == (2, 4, 1)
    out = b.kron_eigen_solve(torch.ones(2, 3), torch.eye(3), torch.ones(4), torch.eye(4), torch.ones(3, 4), 0.1)
    assert out.shape == (2, 3, 4)


@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
def test_curvature_solve_refuses_a_damping_beyond_its_dtype(approx: str) -> None:
    m = _model()
    x, y = torch.randn(7, 3), torch.randint(0, 2, (7,))
    c = curvature.compute(m, x, y, approx=approx)
    with pytest.raises(ValueError, match=r"damping=1e\+39 is beyond the largest torch.float32"):
        c.solve(torch.ones(c.numel), 1e39)
    c64 = curvature.compute(_model().double(), x.double(), y, approx=approx)
    out = c64.solve(torch.ones(c64.numel, dtype=torch.float64), 1e39)  # float64 holds it: ≈ 1e-39
    assert torch.allclose(out, torch.full_like(out, 1e-39), rtol=1e-6)


def test_failed_decomposition_names_a_damping_beyond_float32(caplog: pytest.LogCaptureFixture) -> None:
    m = _model()
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    opt = torchsso2.SecondOrderOptimizer(m, damping=1e39)
    with caplog.at_level(logging.WARNING, logger="torchsso2"):
        opt.step(make_closure(opt, m, x, y))
    assert opt.num_skipped == 1
    assert "the damping 1e+39 is beyond the largest float32" in caplog.text
    assert "decomposition_dtype=torch.float64" in caplog.text


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_eigh_beyond_float32_raises(backend: str) -> None:
    a = torch.full((2, 2), 3e38)  # eigenvalues 0 and 6e38: finite in float64 only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(LinalgError, match="exceed the largest torch.float32"):
            get_backend(backend).eigh(a)
    evals, _ = get_backend(backend).eigh(a, dtype=torch.float64)
    assert float(evals.max()) == pytest.approx(6e38)
