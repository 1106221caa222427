"""VIOptimizer's default schedule per ``approx`` (torchsso2/optim/vi_schedule.py).

noisy K-FAC (``approx="kfac"``) estimates the curvature every 10 steps and decomposes each estimate by
default (10/10); ``approx="diag"`` (and ``"full"``, dicts) every step. The default EMA decay is per step
(``0.99999 ** curv_update_interval`` per update). Explicit values are used as given.
"""
from __future__ import annotations

from typing import Any, List

import pytest
import torch
from torch import nn

from torchsso2 import VIOptimizer
from torchsso2.optim.vi import DEFAULT_VI_EMA_DECAY
from torchsso2.optim.vi_schedule import DEFAULT_VI_INTERVALS, vi_schedule

N_DATA = 48


def tiny_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def train(model: nn.Module, opt: VIOptimizer, steps: int) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_DATA, 5, generator=gen)
    y = torch.randint(0, 3, (N_DATA,), generator=gen)
    for t in range(steps):
        idx = torch.arange(t * 8, t * 8 + 8) % N_DATA

        def closure() -> Any:
            opt.zero_grad()
            out = model(x[idx])
            loss = nn.functional.cross_entropy(out, y[idx])
            loss.backward()
            return loss, out
        opt.step(closure)
    return [p.detach().clone() for p in model.parameters()]


def _schedule(opt: VIOptimizer) -> tuple:
    return opt.curv_update_interval, opt.inv_update_interval, opt.ema_decay


@pytest.mark.parametrize("approx, expected", [
    ("diag", (1, 1, DEFAULT_VI_EMA_DECAY)),
    ("kfac", (10, 10, DEFAULT_VI_EMA_DECAY ** 10)),
    ("full", (1, 1, DEFAULT_VI_EMA_DECAY)),
    ({nn.Linear: "kfac"}, (1, 1, DEFAULT_VI_EMA_DECAY)),
], ids=["diag", "kfac", "full", "dict"])
def test_default_schedule_per_approx(approx, expected):
    opt = VIOptimizer(tiny_mlp(), dataset_size=N_DATA, approx=approx)
    assert _schedule(opt) == expected
    assert (opt.settings.curv_update_interval, opt.settings.inv_update_interval) == expected[:2]
    if approx == "diag":  # bit for bit today's decay (the reparam flat step reads opt.ema_decay)
        assert opt.ema_decay == 0.99999 and opt.reparam
    assert DEFAULT_VI_INTERVALS["kfac"] == (10, 10) and DEFAULT_VI_INTERVALS["diag"] == (1, 1)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(curv_update_interval=1, inv_update_interval=1), (1, 1, DEFAULT_VI_EMA_DECAY)),
    (dict(curv_update_interval=2), (2, 10, DEFAULT_VI_EMA_DECAY ** 2)),
    (dict(inv_update_interval=7), (10, 7, DEFAULT_VI_EMA_DECAY ** 10)),
    (dict(ema_decay=0.9), (10, 10, 0.9)),
    (dict(ema_decay=DEFAULT_VI_EMA_DECAY), (10, 10, DEFAULT_VI_EMA_DECAY)),
    (dict(curv_update_interval=5, inv_update_interval=50, ema_decay=0.5), (5, 50, 0.5)),
])
def test_explicit_values_win(kwargs, expected):
    assert _schedule(VIOptimizer(tiny_mlp(), dataset_size=N_DATA, approx="kfac", **kwargs)) == expected


def test_diag_with_an_explicit_interval_gets_the_per_step_decay():
    opt = VIOptimizer(tiny_mlp(), dataset_size=N_DATA, curv_update_interval=3)
    assert _schedule(opt) == (3, 1, DEFAULT_VI_EMA_DECAY ** 3)


def test_kfac_default_estimates_and_decomposes_every_10_steps():
    model = tiny_mlp()
    opt = VIOptimizer(model, dataset_size=N_DATA, approx="kfac", seed=0)
    decomposed_at: List[int] = []
    original = opt._decompose

    def counting(*args: Any, **kw: Any) -> bool:
        decomposed_at.append(opt.num_steps)
        return original(*args, **kw)
    opt._decompose = counting  # type: ignore[method-assign]
    train(model, opt, 35)
    # the isotropic start, then the estimates of steps 0, 10, 20, 30, each decomposed at once
    assert opt.running.num_updates == 1 + 4
    assert decomposed_at == [0, 10, 20, 30]
    assert opt.num_skipped == 0


def test_kfac_default_equals_its_documented_explicit_settings():
    """The default is exactly ``curv_update_interval=10, inv_update_interval=10, ema_decay=0.99999**10``;
    an explicit ``ema_decay=0.99999`` at 10/10 is a decay per update (a different run)."""
    runs = {}
    for name, kw in {"default": {},
                     "explicit": dict(curv_update_interval=10, inv_update_interval=10,
                                      ema_decay=DEFAULT_VI_EMA_DECAY ** 10),
                     "per-update": dict(curv_update_interval=10, inv_update_interval=10,
                                        ema_decay=DEFAULT_VI_EMA_DECAY)}.items():
        model = tiny_mlp()
        opt = VIOptimizer(model, dataset_size=N_DATA, approx="kfac", seed=0, lr=0.1, **kw)
        runs[name] = (train(model, opt, 31), opt)
    for a, b in zip(runs["default"][0], runs["explicit"][0]):
        assert torch.equal(a, b)
    da = runs["default"][1].running.blocks
    db = runs["per-update"][1].running.blocks
    assert any(not torch.equal(x, y) for n in da for x, y in zip(da[n].tensors(), db[n].tensors()))


def test_diag_default_is_today_every_step_schedule_bit_for_bit():
    """approx='diag' at its defaults equals the explicit 1/1 with ema_decay 0.99999 (today's defaults)."""
    out = []
    for kw in ({}, dict(curv_update_interval=1, inv_update_interval=1, ema_decay=0.99999)):
        model = tiny_mlp()
        out.append(train(model, VIOptimizer(model, dataset_size=N_DATA, seed=0, lr=0.1, **kw), 6))
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_vi_schedule_checks_the_interval_before_deriving_the_decay():
    with pytest.raises(ValueError, match="curv_update_interval=0"):
        vi_schedule("kfac", 0, None, None, DEFAULT_VI_EMA_DECAY)
    with pytest.raises(TypeError, match="curv_update_interval"):
        VIOptimizer(tiny_mlp(), dataset_size=N_DATA, approx="kfac", curv_update_interval=2.5)
    with pytest.raises(ValueError, match="inv_update_interval=0"):
        VIOptimizer(tiny_mlp(), dataset_size=N_DATA, approx="kfac", inv_update_interval=0)
    # an explicit decay is not derived from the interval: the interval's own check still runs
    with pytest.raises(ValueError, match="curv_update_interval=0"):
        VIOptimizer(tiny_mlp(), dataset_size=N_DATA, approx="kfac", curv_update_interval=0, ema_decay=0.9)
