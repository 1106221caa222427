"""benchmarks/vi_differences.py: the flat re-implementation of the step VIOptimizer(approx="diag") and
ivon.IVON share, with one switch per difference. Fed the same weight noise it reproduces both real
optimizers weight for weight, so its single swaps measure what each difference does."""
from __future__ import annotations

import copy
from typing import Callable

import numpy as np
import pytest
import torch
from torch import Tensor

from benchmarks import vi_differences as vd
from benchmarks import vi_quality as vq
from benchmarks import vi_splits
from optim_helpers import batch, nll, param_vec, tiny_mlp
from torchsso2 import VIOptimizer
from torchsso2.optim.grid import noise_seed

N_DATA = 100
STEPS = 6


def _posterior(model: torch.nn.Module, settings: vd.StepSettings) -> vd.Posterior:
    params = list(model.parameters())
    mean = param_vec(model)
    prior = settings.weight_decay if settings.weight_decay is not None else settings.prior_precision / N_DATA
    return vd.Posterior(model, params, mean, torch.full_like(mean, settings.curvature_init), prior, N_DATA)


def _closure(model: torch.nn.Module, t: int) -> Callable[[], Tensor]:
    x, y = batch(seed=t)

    def closure() -> Tensor:
        loss = nll("cross_entropy", model(x), y)
        loss.backward()
        return loss
    return closure


def test_ivon_settings_reproduce_ivon():
    ivon = pytest.importorskip("ivon")
    lr = 0.3
    model = tiny_mlp()
    twin = copy.deepcopy(model)
    opt = ivon.IVON(twin.parameters(), lr=lr, ess=N_DATA)
    post = _posterior(model, vd.IVON_SETTINGS)
    momentum = torch.zeros_like(post.mean)
    for t in range(1, STEPS + 1):
        torch.manual_seed(50 + t)  # IVON draws its noise from torch's global generator
        with opt.sampled_params(train=True):
            opt.zero_grad()
            _closure(twin, t)()
        opt.step()
        torch.manual_seed(50 + t)
        z = torch.randn(post.mean.numel(), dtype=post.mean.dtype)
        momentum = vd.step_variant(post, momentum, t, lr, vd.IVON_SETTINGS, _closure(model, t), z)
        assert torch.allclose(post.mean, param_vec(twin), rtol=1e-10, atol=1e-12), t
    hess = opt.param_groups[0]["hess"]
    assert torch.allclose(post.std(), (N_DATA * (hess + 1e-4)).rsqrt(), rtol=1e-10)


@pytest.mark.parametrize("debias,lr", [(False, 10.0), (False, 3.0), (True, 3.0)])
def test_vi_settings_reproduce_vioptimizer(debias: bool, lr: float):
    """VI's settings at IVON's lr ``L`` are VIOptimizer at ``L·(1 − momentum)`` (its KL clip included);
    swapping in IVON's bias correction is ``VIOptimizer(momentum_debias=True)``."""
    seed = 3  # at lr 10 the KL clip binds (without it the weights end 0.69 elsewhere); at 3 it does not
    model = tiny_mlp()
    twin = copy.deepcopy(model)
    opt = VIOptimizer(twin, dataset_size=N_DATA, lr=lr * (1 - vd.MOMENTUM), seed=seed, momentum_debias=debias)
    settings = vd.replace(vd.VI_SETTINGS, debias=debias)
    post = _posterior(model, settings)
    momentum = torch.zeros_like(post.mean)
    for t in range(1, STEPS + 1):
        def closure(t: int = t):
            opt.zero_grad()
            x, y = batch(seed=t)
            out = twin(x)
            loss = nll("cross_entropy", out, y)
            loss.backward()
            return loss, out
        opt.step(closure)
        gen = torch.Generator().manual_seed(noise_seed(seed, t - 1, 0))  # VI's noise of step t (0-based count)
        z = torch.randn(post.mean.numel(), generator=gen, dtype=post.mean.dtype)
        momentum = vd.step_variant(post, momentum, t, lr, settings, _closure(model, t), z)
        assert torch.allclose(post.mean, param_vec(twin), rtol=1e-9, atol=1e-12), t
    assert torch.allclose(post.curvature, torch.cat([b.diagonal for b in opt.running.blocks.values()]), rtol=1e-9)


def test_variants_swap_one_difference_each():
    v = vd.variants()
    assert v["vi"] == vd.VI_SETTINGS and v["ivon"] == vd.IVON_SETTINGS
    for name, change in vd.DIFFERENCES.items():
        swapped = v[f"swap {name}"]
        differing = [f for f in vd.StepSettings.__dataclass_fields__
                     if getattr(swapped, f) != getattr(vd.VI_SETTINGS, f)]
        assert differing == list(change), name
        assert all(getattr(swapped, k) == getattr(vd.IVON_SETTINGS, k) for k in change)


def test_a_variant_trains_and_predicts_on_the_digits_cnn():
    split = vq.load_task("digits-cnn")
    post = vd.train_variant("digits-cnn", split, 0.1, 0, 1, 64, vd.VI_SETTINGS)
    probs = vd.predict_variant(post, split.x_val[:20], 0, vd.VI_SETTINGS, num_samples=4)
    assert probs.shape == (20, 10) and torch.allclose(probs.sum(1), torch.ones(20), atol=1e-5)
    assert 0.99 < float(post.curvature.min()) and float(post.curvature.max()) < 1.01


def test_paired_needs_shared_seeds():
    rows = {0: {"nll": 1.0}, 1: {"nll": 3.0}}
    base = {0: {"nll": 0.5}, 1: {"nll": 1.5}, 2: {"nll": 9.0}}
    mean, se, n = vd.paired(rows, base, "nll")
    assert (mean, n) == (pytest.approx(1.0), 2) and se == pytest.approx(0.5)
    with pytest.raises(ValueError, match="share no seed"):
        vd.paired({5: {"nll": 1.0}}, base, "nll")


def test_splits_paired_counts_ties_as_at_least_as_good():
    """benchmarks/vi_splits.paired: mean, se = std(ddof 1)/√n, and the count of diffs ≤ 0 (a tie counts as
    "VI at least as good"). Reference: numpy; two exact zeros make ≤ and < differ by 2."""
    d = [0.0, -0.2, 0.3, 0.0]
    p = vi_splits.paired(d)
    assert p["vi_at_least_as_good"] == 3 and p["n"] == 4
    assert p["mean"] == pytest.approx(np.mean(d), rel=1e-12, abs=1e-15)
    assert p["se"] == pytest.approx(np.std(d, ddof=1) / 2, rel=1e-12)


def _split_row(k, vi, adam, vi_val, adam_val, fail=False):
    adam_res = ({"lr": None, "error": "diverged"} if fail
                else {"lr": 1, "val_nll": adam_val, "test_nll": adam, "rmse": 1.0})
    return {"split": k, "methods": {"vi-diag": {"lr": 1, "val_nll": vi_val, "test_nll": vi, "rmse": 1.0},
                                    "adam": adam_res}}


def test_summarize_splits_drops_failed_splits_and_pairs_val_and_test():
    """benchmarks/vi_splits.summarize_splits: a split where any method failed (no test_nll) is left out of
    every statistic; the val_nll summary is the validation NLL (not the test NLL); paired vi−adam
    differences on val and test, ties counted as at least as good. Reference: numpy on the three
    usable splits (split 3's test NLLs tie exactly)."""
    rows = [_split_row(0, 1.0, 1.1, 0.9, 0.95), _split_row(1, 2.0, 1.5, 1.9, 1.7),
            _split_row(2, 5.0, None, 4.0, None, fail=True), _split_row(3, 1.2, 1.2, 1.0, 1.3)]
    out = vi_splits.summarize_splits(rows)
    assert out["splits_used"] == [0, 1, 3]
    vi_t, vi_v = np.array([1.0, 2.0, 1.2]), np.array([0.9, 1.9, 1.0])
    ad_t, ad_v = np.array([1.1, 1.5, 1.2]), np.array([0.95, 1.7, 1.3])
    s = out["summary"]["vi-diag"]
    assert s["test_nll"]["mean"] == pytest.approx(vi_t.mean(), rel=1e-12)
    assert s["test_nll"]["std"] == pytest.approx(vi_t.std(ddof=1), rel=1e-12)
    assert s["val_nll"]["mean"] == pytest.approx(vi_v.mean(), rel=1e-12)
    assert out["summary"]["adam"]["val_nll"]["mean"] == pytest.approx(ad_v.mean(), rel=1e-12)
    d = vi_v - ad_v
    pv, pt = out["paired"]["adam"]["val"], out["paired"]["adam"]["test"]
    assert pv["mean"] == pytest.approx(d.mean(), rel=1e-12) and pv["n"] == 3
    assert pv["se"] == pytest.approx(d.std(ddof=1) / np.sqrt(3), rel=1e-12)
    assert pt["vi_at_least_as_good"] == int(((vi_t - ad_t) <= 0).sum()) == 2
