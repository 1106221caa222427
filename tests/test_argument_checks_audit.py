"""Arguments checked at construction with errors naming them (a bad communicator or skip_modules type,
the LM settings whether or not adaptive damping is on, PyTorch-SSO's momentum kinds)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.compat import pytorch_sso
from torchsso2.kfac.scheduler import LambdaParamScheduler


@pytest.mark.parametrize("value", [3, object()])
def test_a_communicator_of_another_type_is_a_type_error(value) -> None:
    model = nn.Linear(3, 2)
    for build in (lambda: SecondOrderOptimizer(model, communicator=value),
                  lambda: VIOptimizer(model, dataset_size=10, communicator=value)):
        with pytest.raises(TypeError, match="communicator must be a backend name .* or a Communicator"):
            build()


def test_skip_modules_that_is_not_a_list_is_named() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match="skip_modules must be a list .* got int 3"):
        curvature.compute(model, torch.randn(4, 3), torch.randint(0, 2, (4,)), skip_modules=3)
    with pytest.raises(TypeError, match="skip_modules must be a list"):
        SecondOrderOptimizer(model, skip_modules=3)


@pytest.mark.parametrize("build", [
    lambda model, skip: curvature.compute(model, torch.randn(4, 3), torch.randint(0, 2, (4,)), skip_modules=skip),
    lambda model, skip: SecondOrderOptimizer(model, skip_modules=skip),
    lambda model, skip: VIOptimizer(model, dataset_size=10, skip_modules=skip),
])
def test_a_skip_modules_entry_matching_no_module_warns(build) -> None:
    """A typo (``"fc3"`` in a model whose layers are ``0`` and ``2``) would leave the layer covered
    without a word: each entry that picks no module is named in a warning; the others do not warn."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"skip_modules entry 'fc3' matches no module .*\['0', '1', '2'\]") as rec:
        build(model, ["fc3", "^2$", nn.Tanh])
    ours = [w for w in rec if "skip_modules entry" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__  # attributed to the caller's line, not the library's
    with pytest.warns(UserWarning, match="skip_modules entry Embedding matches no module"):
        build(model, [nn.Embedding])


@pytest.mark.parametrize("build", [
    lambda model, approx: curvature.compute(model, torch.randn(4, 3), torch.randint(0, 2, (4,)), approx=approx),
    lambda model, approx: SecondOrderOptimizer(model, approx=approx),
    lambda model, approx: VIOptimizer(model, dataset_size=10, approx=approx),
])
def test_an_approx_key_matching_no_module_warns(build) -> None:
    """``approx={"fc2": "diag"}`` in a model whose layers are ``0`` and ``2`` left layer ``2`` at its
    default K-FAC without a word: a string key that picks no module is named in a warning (a type key
    or a torch.nn class name is not: they cannot be misspelt, and a dict written for several models may
    name absent classes)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"approx entry 'fc2' matches no module .*default shape") as rec:
        out = build(model, {"fc2": "diag", "^0$": "diag", nn.Conv2d: "kfac", "BatchNorm2d": "diag"})
    ours = [w for w in rec if "approx entry" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__
    approx = out.approx if hasattr(out, "approx") and isinstance(out.approx, dict) else out.engine.approx
    assert {n: getattr(a, "value", a) for n, a in approx.items()} == {"0": "diag", "2": "kfac"}


def test_a_mistyped_skip_warns_before_the_module_it_was_meant_for_raises() -> None:
    """The typo's warning comes even when the module it was meant to skip then stops the construction."""
    model = nn.Sequential(nn.Linear(3, 3), nn.PReLU())
    with pytest.warns(UserWarning, match="skip_modules entry '\\^11\\$' matches no module"):
        with pytest.raises(ValueError, match="PReLU has trainable parameters"):
            SecondOrderOptimizer(model, skip_modules=["^11$"])


@pytest.mark.parametrize("kwargs,error", [
    (dict(min_damping="abc"), TypeError), (dict(min_damping=float("nan")), ValueError),
    (dict(min_damping=-1.0), ValueError), (dict(damping_adaptation_decay=1.5), ValueError),
    (dict(damping_adaptation_decay="abc"), TypeError), (dict(damping_adaptation_interval=0), ValueError),
])
def test_lm_settings_are_checked_without_adaptive_damping(kwargs, error) -> None:
    with pytest.raises(error, match=next(iter(kwargs))):
        SecondOrderOptimizer(nn.Linear(3, 2), **kwargs)


def test_pytorch_sso_momentum_kinds_are_checked_when_unused() -> None:
    with pytest.raises(ValueError, match="momentum_type='bogus'"):
        pytorch_sso.SecondOrderOptimizer(nn.Linear(3, 2), "Cov", {"Linear": "Kron"}, {"damping": 1e-2},
                                         momentum=0, momentum_type="bogus")


def test_the_scheduler_refuses_a_non_preconditioner_as_type_and_attribute_error() -> None:
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for kind in (TypeError, AttributeError):  # AttributeError: kfac_pytorch's scheduler fails so
        with pytest.raises(kind, match="must be a BaseKFACPreconditioner"):
            LambdaParamScheduler(sgd, damping_lambda=lambda step: 1.0)
