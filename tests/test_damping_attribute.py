"""``SecondOrderOptimizer.damping`` set between steps takes effect at the next step whatever the intervals (K-FAC
eigen decompositions re-damped in place, others decomposed again), and under ``adaptive_damping`` the rule
continues from it; a checkpoint records its likelihood and curvature kind."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer


def _setup(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (32,), generator=g)
    args = dict(approx="kfac", damping=0.1, lr=0.1, kl_clip=None, curv_update_interval=1, inv_update_interval=3, seed=0)
    args.update(kw)
    opt = SecondOrderOptimizer(model, **args)
    return model, opt, make_closure(opt, model, x, y)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_a_damping_set_between_decompositions_takes_effect_at_the_next_step(method):
    """Set after step 1 of an interval of 3: the next step's update is the one the new damping gives with
    the curvature the optimizer holds (its last decomposition's factors), not the old damping's."""
    model, opt, closure = _setup(kfac_method=method, curv_update_interval=100, momentum=0.0)
    opt.step(closure)  # step 0: estimate and decompose at damping 0.1; no estimate again before step 100
    ref_model, ref, ref_closure = _setup(kfac_method=method, curv_update_interval=100, damping=1.0, momentum=0.0)
    ref.step(ref_closure)  # the same curvature, decomposed at damping 1.0
    with torch.no_grad():
        for p, q in zip(ref_model.parameters(), model.parameters()):
            p.copy_(q)  # the same point (the reference's first update differs: its damping did)
    opt.damping = 1.0
    assert opt.damping == 1.0
    opt.step(closure)  # step 1: no scheduled decomposition
    ref.step(ref_closure)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_an_unchanged_damping_keeps_the_decomposition():
    model, opt, closure = _setup(kfac_method="inverse", curv_update_interval=100)
    opt.step(closure)
    decs = {n: b.decomposition for n, b in opt.running.blocks.items()}
    opt.damping = 0.1
    assert not opt._redamp_pending
    opt.step(closure)
    assert all(b.decomposition is decs[n] for n, b in opt.running.blocks.items())


def test_adaptive_damping_continues_from_a_set_damping():
    model, opt, closure = _setup(adaptive_damping=True, damping_adaptation_interval=3)
    for _ in range(4):
        opt.step(closure)
    opt.damping = 1.0
    assert opt.lm.damping == 1.0
    for _ in range(2):  # step 5 adjusts (every third step): from 1.0 by one factor ω or 1/ω
        opt.step(closure)
    assert opt.damping in (pytest.approx(1.0 * opt.lm.decay), pytest.approx(1.0 / opt.lm.decay), 1.0)
    assert opt.damping == opt.lm.damping


@pytest.mark.parametrize("value, match", [(-1.0, "damping"), (float("nan"), "damping"), ("0.1", "damping"),
                                          (1e-12, r"outside the adaptive damping rule's \[min_damping, 1e4\]"),
                                          (1e5, r"outside the adaptive damping rule's")])
def test_a_bad_damping_is_refused_and_changes_nothing(value, match):
    _, opt, _ = _setup(adaptive_damping=True)
    with pytest.raises((ValueError, TypeError), match=match):
        opt.damping = value
    assert opt.damping == 0.1 and opt.lm.damping == 0.1


def test_zero_damping_without_the_rule_is_allowed():
    model, opt, closure = _setup(approx="diag", kl_clip=None)
    opt.step(closure)
    opt.damping = 0.0
    assert opt.damping == 0.0 and opt._redamp_pending


# ---- the checkpoint's likelihood and curvature kind ----------------------------------------------
def _trained(face, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    opt = SecondOrderOptimizer(model, **kw) if face == "soo" else VIOptimizer(model, dataset_size=64, **kw)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=g) if kw.get("loss", "cross_entropy") == "cross_entropy" \
        else torch.randn(16, 3, generator=g, dtype=torch.float64)
    opt.step(make_closure(opt, model, x, y, loss=kw.get("loss", "cross_entropy")))
    return model, opt


def _state_tensors(sd, name):
    return sd["torchsso2"]["curvature"]["blocks"][name]["tensors"]


@pytest.mark.parametrize("face", ["soo", "vi"])
def test_a_checkpoint_of_another_loss_is_refused(face):
    _, opt = _trained(face)
    sd = opt.state_dict()
    assert sd["torchsso2"]["loss"] == "cross_entropy"
    _, other = _trained(face, loss="mse")
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"\['loss'\] is 'cross_entropy', this optimizer's loss is 'mse'"):
        other.load_state_dict(sd)
    after = other.state_dict()
    assert after["torchsso2"]["loss"] == "mse" and after["torchsso2"]["num_steps"] == before["torchsso2"]["num_steps"]
    for name, blk in other.running.blocks.items():  # the statistics are this optimizer's own still
        for t, u in zip(blk.tensors(), _state_tensors(before, name)):
            assert torch.equal(t, u)


@pytest.mark.parametrize("face, saved, loading", [("soo", "fisher_mc", "empirical_fisher"),
                                                  ("vi", None, "fisher_mc")])
def test_a_checkpoint_of_another_curvature_kind_loads_with_a_warning(face, saved, loading):
    kw = {} if saved is None else {"curvature": saved}
    approx = {"approx": "diag"} if face == "vi" else {}
    _, opt = _trained(face, **kw, **approx)
    sd = opt.state_dict()
    assert sd["torchsso2"]["curvature_kind"] == (saved or "reparam")
    _, other = _trained(face, curvature=loading, **approx)
    with pytest.warns(UserWarning, match=rf"estimated with curvature='{saved or 'reparam'}', this optimizer "
                                         rf"estimates curvature='{loading}'"):
        other.load_state_dict(sd)
    assert other.num_steps == opt.num_steps


def test_a_checkpoint_without_the_new_entries_loads_quietly():
    _, opt = _trained("soo")
    sd = opt.state_dict()
    for key in ("loss", "curvature_kind"):
        del sd["torchsso2"][key]
    del sd["torchsso2"]["extra"]["redamp_pending"]
    _, other = _trained("soo", loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.load_state_dict(sd)
    assert not other._redamp_pending
