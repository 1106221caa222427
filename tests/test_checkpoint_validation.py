"""load_state_dict of SecondOrderOptimizer and VIOptimizer checks the whole checkpoint against the
model, then applies it all or nothing (issue 28 item 11, issue 33 item 2).

Every refused checkpoint raises a ValueError naming the entry, leaves ``state_dict()`` exactly as
before, and a later step still works."""
from __future__ import annotations

import copy

import pytest
import torch

from optim_helpers import batch, make_closure, param_vec, tiny_mlp
from test_optim_common import _resume_opt, assert_same_state

FACES = ["second_order", "vi"]


def _trained(face, approx="kfac", seed=0, steps=4):
    model, (x, y) = tiny_mlp(seed=seed), batch()
    opt = _resume_opt(face, approx, model, seed=seed)
    for _ in range(steps):
        opt.step(make_closure(opt, model, x, y))
    return model, opt


def _refused(opt, model, ck, match):
    """``load_state_dict(ck)`` raises ValueError(match); state and parameters unchanged; a step works."""
    before, params = copy.deepcopy(opt.state_dict()), param_vec(model)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(ck)
    assert_same_state(opt.state_dict(), before)
    assert torch.equal(param_vec(model), params)
    x, y = batch(seed=5)
    opt.step(make_closure(opt, model, x, y))
    assert opt.num_skipped == before["torchsso2"]["num_skipped"]
    assert torch.isfinite(param_vec(model)).all() and not torch.equal(param_vec(model), params)


@pytest.mark.parametrize("face", FACES)
def test_a_checkpoint_of_the_other_optimizer_is_refused(face):
    other = "vi" if face == "second_order" else "second_order"
    _, source = _trained(other)
    model, opt = _trained(face, seed=1)
    saved_by = "VIOptimizer" if other == "vi" else "SecondOrderOptimizer"
    _refused(opt, model, copy.deepcopy(source.state_dict()), f"saved by a {saved_by}")
    # an untagged (older) checkpoint is recognised by its face-specific entries
    ck = copy.deepcopy(source.state_dict())
    del ck["torchsso2"]["optimizer"]
    _refused(opt, model, ck, f"saved by a {saved_by}")


@pytest.mark.parametrize("face", FACES)
def test_a_kfac_preconditioner_checkpoint_is_named(face):
    """A KFACPreconditioner's (or kfac_pytorch's) dict was 'saved by a different optimizer'."""
    from torchsso2.kfac import KFACPreconditioner
    model, opt = _trained(face, seed=1)
    ck = KFACPreconditioner(tiny_mlp(seed=2)).state_dict()
    _refused(opt, model, ck, r"KFACPreconditioner \(kfac_pytorch\) checkpoint .*KFACPreconditioner.load_state_dict")
    del ck["torchsso2"]  # exactly kfac_pytorch's keys
    _refused(opt, model, ck, r"KFACPreconditioner \(kfac_pytorch\) checkpoint")
    without_factors = KFACPreconditioner(tiny_mlp(seed=2)).state_dict(include_factors=False)  # no 'layers'
    _refused(opt, model, without_factors, r"KFACPreconditioner \(kfac_pytorch\) checkpoint")


@pytest.mark.parametrize("face", FACES)
def test_a_momentum_buffer_of_the_wrong_size_is_refused(face):
    """The segfault case: 5 elements instead of the parameter's (torch._fused_sgd_ checks no shapes)."""
    model, opt = _trained(face)
    ck = copy.deepcopy(opt.state_dict())
    key = next(iter(ck["state"]))
    ck["state"][key]["momentum_buffer"] = torch.zeros(5, dtype=torch.float64)
    _refused(opt, model, ck, r"\['state'\]\[0\]\['momentum_buffer'\] \(parameter 'fc1.weight'\) has shape \[5\]")


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("bad", ["nan_buffer", "int_buffer", "nan_factor", "nan_decomposition", "nan_lr",
                                 "missing_group_key", "generator", "num_steps", "missing_state"])
def test_a_bad_entry_is_refused_and_named(face, bad):
    model, opt = _trained(face)
    ck = copy.deepcopy(opt.state_dict())
    blocks = ck["torchsso2"]["curvature"]["blocks"]
    key = next(iter(ck["state"]))
    if bad == "nan_buffer":
        ck["state"][key]["momentum_buffer"][0, 0] = float("nan")
        match = "momentum_buffer.*NaN or inf"
    elif bad == "int_buffer":
        ck["state"][key]["momentum_buffer"] = ck["state"][key]["momentum_buffer"].long()
        match = "momentum_buffer.*dtype torch.int64"
    elif bad == "nan_factor":  # the last block: the first ones are fine, nothing may be applied
        blocks["fc2"]["tensors"][1][0, 0] = float("inf")
        match = r"\['fc2'\]\['tensors'\]\[1\] holds NaN or inf"
    elif bad == "nan_decomposition":
        blocks["fc2"]["decomposition"]["denom"][0, 0] = float("nan")
        match = r"\['fc2'\]\['decomposition'\]\['denom'\] holds NaN"
    elif bad == "nan_lr":
        ck["param_groups"][0]["lr"] = float("nan")
        match = r"\['param_groups'\]\[0\]\['lr'\]"
    elif bad == "missing_group_key":
        del ck["param_groups"][0]["momentum"]
        match = "has no 'momentum'"
    elif bad == "generator":
        ck["torchsso2"]["generator"] = torch.zeros(3, dtype=torch.uint8)
        match = "generator"
    elif bad == "missing_state":  # it said "is a NoneType"
        del ck["state"]
        match = r"\['state'\] is missing"
    else:
        ck["torchsso2"]["num_steps"] = -1
        match = "num_steps"
    _refused(opt, model, ck, match)


@pytest.mark.parametrize("face", FACES)
def test_statistics_are_checked_against_the_model_not_against_the_checkpoint(face):
    """A K-FAC factor (and its decomposition) one row and column too large, consistent with itself:
    the model's fc1 has a [5, 5] parameter matrix (4 inputs + bias), so the factor must be [5, 5]."""
    model, opt = _trained(face)
    ck = copy.deepcopy(opt.state_dict())
    blk = ck["torchsso2"]["curvature"]["blocks"]["fc1"]
    a = blk["tensors"][1]
    n = a.shape[0] + 1
    big = torch.eye(n, dtype=a.dtype)
    big[:-1, :-1] = a
    blk["tensors"][1] = big
    blk["decomposition"] = None
    _refused(opt, model, ck, r"\['fc1'\]\['tensors'\]\[1\] has shape \[6, 6\].*expected \[5, 5\] or \[5\]")


@pytest.mark.parametrize("face", FACES)
def test_loaded_state_does_not_alias_the_checkpoint_and_takes_the_model_dtype(face):
    """The checkpoint's tensors are copied (training on does not write into it) and cast to the
    model's dtype (a float32 copy of a float64 checkpoint loads as float64)."""
    model, opt = _trained(face)
    ck = copy.deepcopy(opt.state_dict())
    reference = copy.deepcopy(ck)
    low = copy.deepcopy(ck)
    for entry in low["state"].values():
        entry["momentum_buffer"] = entry["momentum_buffer"].float()
    for blk in low["torchsso2"]["curvature"]["blocks"].values():
        blk["tensors"] = [t.float() for t in blk["tensors"]]
    opt.load_state_dict(ck)
    x, y = batch(seed=3)
    for _ in range(2):
        opt.step(make_closure(opt, model, x, y))
    assert_same_state(ck, reference)  # the caller's checkpoint was not written into
    opt.load_state_dict(low)
    assert all(t.dtype == torch.float64 for b in opt.running.blocks.values() for t in b.tensors())
    assert all(s["momentum_buffer"].dtype == torch.float64 for s in opt.state.values())
    opt.step(make_closure(opt, model, x, y))
    assert torch.isfinite(param_vec(model)).all()


def test_state_dict_that_is_not_a_dict_is_a_type_error():
    model, opt = _trained("second_order", steps=1)
    with pytest.raises(TypeError, match="state_dict"):
        opt.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="no 'torchsso2' entry"):
        opt.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())
    # what torch.distributed.checkpoint's get_optimizer_state_dict keeps: 'state' and 'param_groups' only
    kept = {k: v for k, v in opt.state_dict().items() if k in ("state", "param_groups")}
    with pytest.raises(ValueError, match=r"torch.distributed.checkpoint's get_state_dict / get_optimizer_state_dict, "
                                         r"which keep only 'state' and 'param_groups'.*save opt.state_dict\(\) with "
                                         r"torch.save"):
        opt.load_state_dict(kept)
