"""torch.optim ecosystem cases an audit found: a live ``weight_decay=inf``; group keys refused by
``add_param_group`` but set on a live group or restored from a checkpoint; VIOptimizer's diagonal fast
path checking its groups first; ``step()`` without a closure naming torch.distributed.checkpoint."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer


def _setup(face: str, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = SecondOrderOptimizer(model, **kw) if face == "soo" else VIOptimizer(model, dataset_size=64, **kw)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    return model, opt, make_closure(opt, model, x, y)


def test_live_weight_decay_inf_is_refused_at_the_next_step() -> None:
    model, opt, closure = _setup("soo")
    opt.step(closure)
    opt.param_groups[0]["weight_decay"] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['weight_decay'\]=inf must be finite"):
        opt.step(closure)
    assert opt.num_skipped == 0 and all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("face,key,value", [("soo", "maximize", True), ("soo", "damping", 10.0),
                                            ("soo", "nesterov", True), ("vi", "maximize", True),
                                            ("vi", "prior_precision", 5.0), ("soo", "ema_decay", 0.5),
                                            ("soo", "kl_clip", 1e-3), ("vi", "kl_weighting", 0.1),
                                            ("vi", "curv_update_interval", 5)])
def test_refused_group_keys_set_live_or_in_a_checkpoint(face: str, key: str, value) -> None:
    model, opt, closure = _setup(face)
    opt.step(closure)
    sd = copy.deepcopy(opt.state_dict())
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=rf"param_groups\[0\] keys \['{key}'\] are options"):
        opt.step(closure)
    del opt.param_groups[0][key]
    sd["param_groups"][0][key] = value
    with pytest.raises(ValueError, match=rf"\['param_groups'\]\[0\] has keys \['{key}'\].*unchanged"):
        opt.load_state_dict(sd)
    opt.step(closure)


@pytest.mark.parametrize("value", [None, [0.1], torch.tensor([0.1, 0.2])])
def test_vi_diagonal_fast_path_checks_its_groups_first(value) -> None:
    _, opt, closure = _setup("vi")
    opt.step(closure)
    opt.step(closure)  # decomposed: the next step qualifies for the flat path
    opt.param_groups[0]["lr"] = value
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['lr'\] must be a real number"):
        opt.step(closure)


@pytest.mark.parametrize("face", ["soo", "vi"])
def test_step_without_a_closure_names_distributed_checkpoint(face: str) -> None:
    _, opt, _ = _setup(face)
    with pytest.raises(TypeError, match="needs a closure.*torch.distributed.checkpoint"):
        opt.step()


@pytest.mark.parametrize("face", ["soo", "vi"])
def test_step_without_a_closure_points_closure_less_loops_to_kfac_preconditioner(face: str) -> None:
    """A loop that calls backward() then step() (Hugging Face Trainer, accelerate) is told what a closure
    must do and where K-FAC fits such a loop; a closure that is not callable gets the contract only."""
    _, opt, _ = _setup(face)
    with pytest.raises(TypeError, match=r"zero-grads, runs the model's forward, calls backward\(\) and returns "
                                        r"the loss \(or \(loss, output\)\).*KFACPreconditioner: precond.step\(\) after the backward"):
        opt.step()
    with pytest.raises(TypeError) as info:
        opt.step(3)
    assert "returns the loss (or (loss, output))" in str(info.value) and "KFACPreconditioner" not in str(info.value)
