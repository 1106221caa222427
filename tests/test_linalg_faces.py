"""The linalg backend is selectable on every face and gives the same numbers (issue #8)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from optim_helpers import make_closure
from torchsso2 import KFACPreconditioner, SecondOrderOptimizer, VIOptimizer


def _setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(16, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (16,))
    return model, x, y


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _train(face, backend, approx, monkeypatch=None):
    model, x, y = _setup()
    if face == "sso":
        opt = SecondOrderOptimizer(model, lr=0.1, curvature="fisher", approx=approx, damping=1e-2, linalg=backend)
    else:
        opt = VIOptimizer(model, dataset_size=100, lr=0.05, curvature="fisher", approx=approx, linalg=backend, seed=3)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out

    for _ in range(3):
        opt.step(closure)
    return _flat(model)


@pytest.mark.parametrize("face", ["sso", "vi"])
@pytest.mark.parametrize("approx", ["kfac", "diag", "full"])
def test_numpy_backend_matches_torch_on_optimizers(face, approx):
    a = _train(face, "torch", approx)
    b = _train(face, "numpy", approx)
    assert (a - _flat(_setup()[0])).abs().max() > 1e-3  # it trained
    assert torch.allclose(a, b, atol=1e-9, rtol=1e-8)


def test_env_var_selects_backend(monkeypatch):
    monkeypatch.setenv("TORCHSSO2_LINALG", "numpy")
    a = _train("sso", None, "kfac")
    monkeypatch.setenv("TORCHSSO2_LINALG", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        _train("sso", None, "kfac")
    monkeypatch.delenv("TORCHSSO2_LINALG")
    assert torch.allclose(a, _train("sso", None, "kfac"), atol=1e-9)


def test_the_env_var_is_read_once_at_construction(monkeypatch, caplog):
    import logging
    model, x, y = _setup()
    monkeypatch.setenv("TORCHSSO2_LINALG", "numpy")
    with caplog.at_level(logging.DEBUG, logger="curvature.linalg.select"):
        opt = SecondOrderOptimizer(model)
    assert opt.linalg == "numpy" and "from environment variable TORCHSSO2_LINALG" in caplog.text
    monkeypatch.setenv("TORCHSSO2_LINALG", "bogus")  # a change mid-run does not switch the run's backend
    closure = make_closure(opt, model, x, y)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="curvature.linalg.select"):
        for _ in range(3):
            opt.step(closure)
    assert "selected" not in caplog.text  # no line per decomposition


def test_kfac_preconditioner_numpy_backend_matches_torch():
    grads = []
    for backend in ("torch", "numpy"):
        model, x, y = _setup()
        pre = KFACPreconditioner(model, linalg=backend, damping=1e-2)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-9, rtol=1e-8)


def test_cupy_without_gpu_is_a_clear_error():
    pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the error path is for machines without one")
    model, _, _ = _setup()
    with pytest.raises((ImportError, RuntimeError), match="torch"):
        SecondOrderOptimizer(model, linalg="cupy")
