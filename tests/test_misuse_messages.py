"""Common mistakes named: zero_grad() after backward() in the closure, KFACPreconditioner.step() before any
forward/backward or given the parameters, targets on another device, a forward-less container as the model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


X, Y = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0, 1, 2])


@pytest.mark.parametrize("face", ["second_order", "vi"])
@pytest.mark.parametrize("good_first", [False, True])
def test_zero_grad_after_backward_in_the_closure_is_named(face: str, good_first: bool) -> None:
    model = _model()
    opt = SecondOrderOptimizer(model) if face == "second_order" else VIOptimizer(model, dataset_size=100)

    good = make_closure(opt, model, X, Y)

    def bad():
        loss, out = good()
        opt.zero_grad()  # clears what backward just wrote
        return loss, out
    if good_first:
        opt.step(good)
    steps = opt.num_steps
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after loss.backward\(\)"):
        opt.step(bad)
    assert opt.num_steps == steps
    opt.step(good)


@pytest.mark.parametrize("case", ["nothing", "forward only"])
def test_kfac_preconditioner_step_before_a_forward_and_backward_raises_and_counts_nothing(case: str) -> None:
    model = _model()
    pre = KFACPreconditioner(model)
    if case == "forward only":
        model(X)
    with pytest.raises(RuntimeError, match="there are no factors to precondition with"):
        pre.step()
    assert pre.steps == 0
    F.cross_entropy(model(X), Y).backward()
    pre.step()
    assert pre.steps == 1


def test_kfac_preconditioner_given_the_parameters_says_pass_the_model() -> None:
    with pytest.raises(TypeError, match=r"takes the model .* not its parameters.*skip_layers"):
        KFACPreconditioner(_model().parameters())


def test_targets_on_another_device_are_named() -> None:
    model = _model()
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher")
    closure = make_closure(opt, model, X, Y)
    with pytest.raises(ValueError, match="targets are on device meta, the model output on cpu"):
        opt.step(closure, targets=Y.to("meta"))
    assert opt.num_steps == 0
    opt.step(closure, targets=Y)


def test_a_container_without_forward_is_refused_where_the_forward_is_recorded() -> None:
    layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 3)])
    for build in (lambda: SecondOrderOptimizer(layers), lambda: VIOptimizer(layers, dataset_size=10, approx="kfac")):
        with pytest.raises(TypeError, match="ModuleList has no forward"):
            build()
    VIOptimizer(layers, dataset_size=10)  # the default diagonal needs the gradients only
