"""A failed or non-finite eigendecomposition is retried in float64, then with jitter, before the
step is skipped; the skip message says which decomposition the step used and suggests
``decomposition_dtype=torch.float64`` (issue #28 item 7). LAPACK's float32 failures are not
reproducible across machines, so ``torch.linalg.eigh`` is patched to fail the way it does."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from curvature.linalg import LinalgError, get_backend
from curvature.linalg.eigh_retry import EighRetryWarning
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from optim_helpers import make_closure

REAL_EIGH = torch.linalg.eigh


def _spd(n: int = 6, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    return (m @ m.t() + 0.1 * torch.eye(n, dtype=torch.float64)).to(dtype)


def _fail_in(dtypes, how="raise", calls=None):
    def eigh(a):
        if calls is not None:
            calls.append(a.dtype)
        if a.dtype in dtypes:
            if how == "raise":
                raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
            w, v = REAL_EIGH(a)
            return w * float("nan"), v
        return REAL_EIGH(a)
    return eigh


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_float32_failure_is_recomputed_in_float64(monkeypatch, how):
    a = _spd()
    calls = []
    monkeypatch.setattr(torch.linalg, "eigh", _fail_in({torch.float32}, how, calls))
    with pytest.warns(EighRetryWarning, match="recomputed in float64.*decomposition_dtype=torch.float64"):
        evals, evecs = get_backend("torch").eigh(a)
    assert calls == [torch.float32, torch.float64]
    assert evals.dtype == evecs.dtype == torch.float32
    w, v = REAL_EIGH(a.double())
    assert torch.allclose(evals.double(), w, rtol=1e-6, atol=1e-6)
    assert torch.allclose(evecs.double() @ torch.diag(evals.double()) @ evecs.double().t(), a.double(), atol=1e-5)


def test_float64_failure_is_retried_with_jitter_and_eigenvalues_unshifted(monkeypatch):
    a = _spd(dtype=torch.float64)
    calls = []

    def eigh(m):  # fails on the exact matrix, succeeds on the jittered one
        calls.append(m.clone())
        if len(calls) == 1:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return REAL_EIGH(m)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    with pytest.warns(EighRetryWarning, match="jitter"):
        evals, evecs = get_backend("torch").eigh(a)
    assert len(calls) == 2 and not torch.equal(calls[1], calls[0])  # the retry saw a + εI
    assert torch.allclose(evals, REAL_EIGH(a)[0], rtol=0, atol=1e-10)
    assert torch.allclose(evecs @ torch.diag(evals) @ evecs.t(), a, atol=1e-10)


def test_every_attempt_failing_raises_naming_them(monkeypatch):
    monkeypatch.setattr(torch.linalg, "eigh", _fail_in({torch.float32, torch.float64}))
    with pytest.raises(LinalgError, match="every attempt.*float32.*float64.*jitter"):
        get_backend("torch").eigh(_spd())


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_optimizer_step_survives_a_float32_eigh_failure(monkeypatch, face):
    x, y = _data()
    params = []
    for fail in (False, True):
        model = _mlp()
        opt = (SecondOrderOptimizer(model, lr=0.1, approx="kfac", damping=1e-2, seed=0) if face == "sso" else
               VIOptimizer(model, dataset_size=100, lr=0.01, approx="full", prior_precision=1.0, seed=0))
        if fail:
            monkeypatch.setattr(torch.linalg, "eigh", _fail_in({torch.float32}))
        else:
            if face == "vi":  # same float32 weight noise in both runs: fix the noise kind before widening
                assert opt._noise_dtype == torch.float32
            opt.decomposition_dtype = torch.float64  # the reference: decomposed in double from the start
        with pytest.warns(EighRetryWarning) if fail else _nothing():
            for _ in range(3):
                opt.step(make_closure(opt, model, x, y))
        monkeypatch.setattr(torch.linalg, "eigh", REAL_EIGH)
        assert opt.num_skipped == 0
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-5)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_skip_message_says_whether_a_previous_decomposition_exists(monkeypatch, caplog):
    x, y = _data()
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.1, approx="kfac", damping=1e-2, seed=0)
    monkeypatch.setattr(torch.linalg, "eigh", _fail_in({torch.float32, torch.float64}))
    before = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING, logger="torchsso2.optim.base"):
        opt.step(make_closure(opt, model, x, y))
    assert opt.num_skipped == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    msg = caplog.records[-1].getMessage()
    assert "no earlier decomposition" in msg and "parameters unchanged" in msg
    assert "previous" not in msg
    assert "decomposition_dtype=torch.float64" in msg

    monkeypatch.setattr(torch.linalg, "eigh", REAL_EIGH)
    opt.step(make_closure(opt, model, x, y))  # decomposes
    monkeypatch.setattr(torch.linalg, "eigh", _fail_in({torch.float32, torch.float64}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchsso2.optim.base"):
        opt.step(make_closure(opt, model, x, y))
    msg = caplog.records[-1].getMessage()
    assert "keeps its previous decomposition" in msg and "decomposition_dtype=torch.float64" in msg

    opt.decomposition_dtype = torch.float64  # already in double: only damping is left to suggest
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="torchsso2.optim.base"):
        opt.step(make_closure(opt, model, x, y))
    record = [r for r in caplog.records if "decomposition failed" in r.getMessage()][-1]
    assert record.levelno == logging.DEBUG  # the 3rd failure: thinned out like skips (1, 2, 5, 10, ...)
    assert "increase damping" in record.getMessage() and "decomposition_dtype" not in record.getMessage()
