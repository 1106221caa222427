"""VIOptimizer on sequence logits ``[N, T, C]`` (targets ``[N, T]``): every Fisher kind and the
K-FAC reductions train a small token model, and ``predict`` is the Bayesian model average over
posterior samples of the per-position softmax, ``[N, T, C]``."""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import VIOptimizer

N, T, V, C = 8, 5, 7, 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 8), nn.Tanh(), nn.Linear(8, C)).double()


def _data() -> Any:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (N, T), generator=g)
    return x, (x + 1) % C  # learnable: the next class of each token


@pytest.mark.parametrize("kwargs", [
    dict(),  # diag, curvature from the same backward (the default)
    dict(curvature="fisher"),
    dict(curvature="empirical_fisher"),
    dict(curvature="fisher_mc"),
    dict(approx="kfac", kfac_approx="expand"),
    dict(approx="kfac", kfac_approx="reduce"),
], ids=["reparam", "fisher", "empirical_fisher", "fisher_mc", "kfac-expand", "kfac-reduce"])
def test_vi_trains_on_sequence_logits(kwargs: Dict[str, Any]) -> None:
    model, (x, y) = _model(), _data()
    opt = VIOptimizer(model, dataset_size=64, lr=0.1, seed=0, **kwargs)

    def closure() -> Any:
        opt.zero_grad()
        out = model(x)  # [N, T, C] straight into the loss
        loss = F.cross_entropy(out.reshape(-1, C), y.reshape(-1))
        loss.backward()
        return loss, out

    with torch.no_grad():
        before = float(F.cross_entropy(model(x).reshape(-1, C), y.reshape(-1)))
    for _ in range(30):
        opt.step(closure, targets=y)
    assert opt.num_skipped == 0
    with torch.no_grad():
        after = float(F.cross_entropy(model(x).reshape(-1, C), y.reshape(-1)))
    assert after < 0.7 * before, (before, after)


def test_predict_on_sequence_logits_is_the_bayesian_model_average() -> None:
    model, (x, y) = _model(), _data()
    opt = VIOptimizer(model, dataset_size=64, lr=0.1, seed=0)
    for _ in range(3):
        opt.step(lambda: _closure(opt, model, x, y))
    got = opt.predict(x, num_samples=5, generator=torch.Generator().manual_seed(3), antithetic=False)
    gen = torch.Generator().manual_seed(3)
    want = []
    with torch.no_grad():
        for _ in range(5):
            with opt.sampled_params(gen):
                want.append(torch.softmax(model(x), dim=-1))
    want_mean = torch.stack(want).mean(0)
    assert got.shape == (N, T, C)
    torch.testing.assert_close(got, want_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.sum(-1), torch.ones(N, T, dtype=got.dtype))
    assert float((torch.stack(want) - want_mean).abs().max()) > 1e-6  # the samples differ: an average, not a copy


def _closure(opt: VIOptimizer, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
    opt.zero_grad()
    out = model(x)
    loss = F.cross_entropy(out.reshape(-1, C), y.reshape(-1))
    loss.backward()
    return loss, out
