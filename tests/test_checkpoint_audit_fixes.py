"""Checkpoints: the loaded decompositions are the optimizer's own copies, widened to the run's dtype;
the skip streak and the AMP skip count survive a resume."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from optim_helpers import make_closure
from torchsso2 import NonFiniteError, SecondOrderOptimizer, VIOptimizer


def _setup(face: str, dtype: torch.dtype = torch.float32, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)
    opt = SecondOrderOptimizer(model, inv_update_interval=7, **kw) if face == "second_order" \
        else VIOptimizer(model, dataset_size=32, approx="kfac", inv_update_interval=7, **kw)
    return model, opt


def _data(dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(3)
    return torch.randn(32, 4, generator=g).to(dtype), torch.randint(0, 3, (32,), generator=g)


@pytest.mark.parametrize("face", ["second_order", "vi"])
def test_a_loaded_decomposition_is_a_copy_the_caller_cannot_change(face: str) -> None:
    model, opt = _setup(face)
    x, y = _data()
    for _ in range(2):
        opt.step(make_closure(opt, model, x, y))
    sd = opt.state_dict()
    runs = []
    for mutate in (False, True):
        model2, opt2 = _setup(face)
        model2.load_state_dict(model.state_dict())
        mine = {k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()} if isinstance(v, dict)
                else v for k, v in sd.items()}
        opt2.load_state_dict(sd if not mutate else mine)
        if mutate:  # the caller reuses its dict after loading
            for block in mine["torchsso2"]["curvature"]["blocks"].values():
                for value in (block["decomposition"] or {}).values():
                    if torch.is_tensor(value) and value.is_floating_point():
                        value.mul_(3.0)
        for _ in range(3):
            opt2.step(make_closure(opt2, model2, x, y))
        runs.append(torch.cat([p.detach().reshape(-1) for p in model2.parameters()]))
    assert torch.equal(runs[0], runs[1])
    for blk in opt.running.blocks.values():  # the saving optimizer's decompositions are not the loader's
        for name, blk2 in opt2.running.blocks.items():
            for key, value in (blk2.decomposition or {}).items():
                if torch.is_tensor(value):
                    assert all(value is not v for v in (blk.decomposition or {}).values())


def test_a_float32_checkpoint_in_a_float64_run_has_float64_decompositions() -> None:
    model, opt = _setup("second_order")
    x, y = _data()
    opt.step(make_closure(opt, model, x, y))
    model64, opt64 = _setup("second_order", torch.float64)
    opt64.load_state_dict(opt.state_dict())
    for blk in opt64.running.blocks.values():
        assert {v.dtype for v in blk.decomposition.values() if torch.is_tensor(v)} == {torch.float64}
    x64 = x.double()
    opt64.step(make_closure(opt64, model64, x64, y))  # runs in float64


@pytest.mark.parametrize("face", ["second_order", "vi"])
def test_the_skip_streak_is_saved_so_a_resume_stops_where_the_run_would(face: str) -> None:
    model, opt = _setup(face, max_consecutive_skips=3)
    x, y = _data()
    opt.step(make_closure(opt, model, x, y))
    bad = torch.full_like(x, float("nan"))
    for _ in range(2):
        opt.step(make_closure(opt, model, bad, y))
    sd = opt.state_dict()
    assert sd["torchsso2"]["consecutive_skips"] == 2
    model2, opt2 = _setup(face, max_consecutive_skips=3)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    with pytest.raises(NonFiniteError, match="3 consecutive steps"):
        opt2.step(make_closure(opt2, model2, bad, y))
    # a checkpoint without the entry (older) loads with no streak
    del sd["torchsso2"]["consecutive_skips"], sd["torchsso2"]["num_amp_skipped"]
    model3, opt3 = _setup(face, max_consecutive_skips=3)
    opt3.load_state_dict(sd)
    opt3.step(make_closure(opt3, model3, bad, y))
    assert opt3.num_skipped == 3


def test_the_amp_skip_count_is_saved() -> None:
    model, opt = _setup("second_order")
    opt.num_amp_skipped = 4  # as left by GradScaler overflows (tests/test_autocast.py)
    model2, opt2 = _setup("second_order")
    opt2.load_state_dict(opt.state_dict())
    assert opt2.num_amp_skipped == 4
