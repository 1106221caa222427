"""KFACPreconditioner on models an audit found mishandled: a layer called twice per forward with
gradient accumulation, a deep copy of a model the preconditioner is attached to, an unbatched
(1-D) Linear input; and the checks of hyper-parameters set by a scheduler."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from torchsso2.kfac import KFACPreconditioner
from torchsso2.kfac.scheduler import LambdaParamScheduler


class Twice(nn.Module):
    """``fc`` called twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


def _factors_after(accumulation: int, in_hook: bool, steps: int = 2) -> torch.Tensor:
    torch.manual_seed(1)
    model = Twice().double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = KFACPreconditioner(model, accumulation_steps=accumulation, update_factors_in_hook=in_hook,
                                 factor_decay=0.5)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        model.zero_grad()
        for _ in range(accumulation):
            model(torch.randn(8, 4, dtype=torch.float64, generator=gen)).pow(2).mean().backward()
        pre.step()
        assert pre.layers["fc"].batch_count == 0 and pre.layers["fc"].a_batch is None  # nothing left over
    return torch.cat([pre.layers["fc"].a_factor.reshape(-1), pre.layers["fc"].g_factor.reshape(-1)])


@pytest.mark.parametrize("accumulation", [1, 2, 3])
def test_a_layer_called_twice_folds_every_call_once_per_step(accumulation: int) -> None:
    """Its 2·k calls of a step are averaged into one fold, wherever the fold happens (the hooks
    get the two calls' gradients in reverse order)."""
    hook = _factors_after(accumulation, True)
    torch.testing.assert_close(hook, _factors_after(accumulation, False), rtol=0, atol=0)


def test_the_step_averages_every_call_of_the_step() -> None:
    """One step of a twice-called layer: A = ½ (1 + mean of the calls' input Grams)."""
    torch.manual_seed(0)
    model = Twice().double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = KFACPreconditioner(model, accumulation_steps=2, factor_decay=0.5)
    xs = [torch.randn(8, 4, dtype=torch.float64) for _ in range(2)]
    grams = []
    for x in xs:
        h = torch.tanh(model.fc(x)).detach()
        for a in (x, h):
            a1 = torch.cat([a, torch.ones(8, 1, dtype=torch.float64)], 1)
            grams.append(a1.t() @ a1 / 8)
        model(x).pow(2).mean().backward()
    pre.step()
    want = 0.5 * torch.eye(5, dtype=torch.float64) + 0.5 * sum(grams) / len(grams)
    torch.testing.assert_close(pre.layers["fc"].a_factor, want)


def test_a_deep_copy_of_the_model_runs_and_leaves_the_original_factors_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    pre = KFACPreconditioner(model)
    clone = copy.deepcopy(model)  # carries the hook (EMA / teacher copies)
    clone(torch.randn(5, 4)).sum().backward()
    assert all(layer.a_batch is None for layer in pre.layers.values())
    own = KFACPreconditioner(clone)  # the copy with a preconditioner of its own
    clone.zero_grad()
    clone(torch.randn(5, 4)).sum().backward()
    own.step()
    assert own.steps == 1 and all(layer.a_factor is not None for layer in own.layers.values())


def test_an_unbatched_linear_input_is_one_example() -> None:
    """``nn.Linear`` on ``[in]`` (valid torch) gives the preconditioned gradient of ``[1, in]``."""
    grads = []
    for shape in ((4,), (1, 4)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
        pre = KFACPreconditioner(model)
        model(torch.arange(4.0, dtype=torch.float64).reshape(shape)).pow(2).sum().backward()
        pre.step()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def _grads_after_steps(**kw) -> torch.Tensor:
    model = _mlp()
    pre = KFACPreconditioner(model, **kw)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(6, 4, dtype=torch.float64, generator=gen)).pow(2).mean().backward()
        pre.step()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_one_element_tensors_are_numbers() -> None:
    """kfac_pytorch accepts ``damping=torch.tensor(0.01)`` and a callable returning a tensor (an
    optimizer's tensor lr): the same steps as the Python numbers."""
    want = _grads_after_steps(damping=0.01, lr=0.1)
    torch.testing.assert_close(_grads_after_steps(damping=torch.tensor(0.01, dtype=torch.float64),
                                                  lr=lambda s: torch.tensor(0.1, dtype=torch.float64)), want,
                               rtol=0, atol=0)
    torch.testing.assert_close(_grads_after_steps(damping=0.01, lr=0.1, accumulation_steps=1.0), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="accumulation_steps"):
        KFACPreconditioner(_mlp(), accumulation_steps=1.5)


@pytest.mark.parametrize("name, fn, error", [("factor_update_steps", lambda s: 0.5, ValueError),
                                             ("damping", lambda s: -1.0, ValueError),
                                             ("kl_clip", lambda s: 0.0, ValueError),
                                             ("lr", lambda s: float("nan"), ValueError)])
def test_values_set_by_the_scheduler_are_checked(name: str, fn, error) -> None:
    model = _mlp()
    pre = KFACPreconditioner(model)
    sched = LambdaParamScheduler(pre, **{f"{name}_lambda": fn})
    model(torch.randn(6, 4, dtype=torch.float64)).pow(2).mean().backward()
    pre.step()
    with pytest.raises(error, match=f"{name}.*set by LambdaParamScheduler at step 1"):
        sched.step()


def test_a_refused_scheduler_step_changes_no_hyper_parameter() -> None:
    """All or nothing: the valid factor_update_steps was doubled before the damping was refused."""
    pre = KFACPreconditioner(_mlp(), factor_update_steps=2, inv_update_steps=4, damping=0.01)
    sched = LambdaParamScheduler(pre, factor_update_steps_lambda=lambda s: 2, damping_lambda=lambda s: -1)
    with pytest.raises(ValueError, match="damping.*no hyper-parameter was changed"):
        sched.step()
    assert (pre.factor_update_steps, pre.damping) == (2, 0.01)


def test_layers_sharing_a_weight_are_announced() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    model[2].weight = model[0].weight
    with pytest.warns(UserWarning, match="layers '0' and '2' share a parameter"):
        KFACPreconditioner(model)


# ---- arguments kfac_pytorch accepts (second audit) ----------------------------------------------
def test_numpy_bool_flags_and_skip_layer_sets_are_accepted():
    """kfac_pytorch takes numpy bools for its flags and any iterable of patterns (strings or compiled)
    for skip_layers; so does ours (a bare string stays a TypeError)."""
    import re

    import numpy as np
    from torchsso2 import KFACPreconditioner

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    pre = KFACPreconditioner(model, symmetry_aware=np.True_, colocate_factors=np.True_,
                             update_factors_in_hook=np.False_)
    assert pre.symmetry_aware is True and pre.update_factors_in_hook is False
    assert list(KFACPreconditioner(model).layers) == ["0", "2"]
    for skip in ({"^2$"}, [re.compile("^2$")], frozenset(["^2$"])):
        assert list(KFACPreconditioner(model, skip_layers=skip).layers) == ["0"]
    with pytest.raises(TypeError, match="skip_layers"):
        KFACPreconditioner(model, skip_layers="fc")


@pytest.mark.parametrize("attr, value, error", [("_damping", float("nan"), ValueError),
                                                ("_damping", -1.0, ValueError),
                                                ("_lr", float("nan"), ValueError),
                                                ("_kl_clip", float("inf"), ValueError),
                                                ("_factor_decay", 1.5, ValueError),
                                                ("_factor_update_steps", float("nan"), TypeError),
                                                ("_inv_update_steps", 0, ValueError)])
def test_values_set_on_the_attributes_between_steps_are_checked(attr: str, value: float, error) -> None:
    """kfac_pytorch's scheduler and users set ``pre._damping`` etc. between steps: a bad number is refused
    at the step that reads it (it had given wrong steps, or a ZeroDivisionError, silently)."""
    model = _mlp()
    pre = KFACPreconditioner(model)
    x = torch.randn(6, 4, dtype=torch.float64)
    model(x).pow(2).mean().backward()
    pre.step()
    setattr(pre, attr, value)
    with pytest.raises(error, match=f"{attr[1:]} must be .*got {value!r} \\(its value at step 1, set after"):
        model.zero_grad()
        model(x).pow(2).mean().backward()
        pre.step()


def test_values_a_scheduler_may_set_between_steps_are_taken() -> None:
    """What a callable may return, a value set between steps may be, and it gives the callable's steps:
    ``factor_decay = 0`` (replace the factors), ``kl_clip = None`` (no clipping), a one-element tensor."""
    def run(switch) -> torch.Tensor:
        model = _mlp()
        pre = KFACPreconditioner(model, **switch(None))
        gen = torch.Generator().manual_seed(0)
        for step in range(4):
            for name, value in switch(step).items():
                setattr(pre, f"_{name}", value)
            model.zero_grad()
            model(torch.randn(6, 4, dtype=torch.float64, generator=gen)).pow(2).mean().backward()
            pre.step()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    initial = {"damping": 0.3, "factor_decay": 0.95, "kl_clip": 1e-3}
    later = {"damping": torch.tensor(0.02, dtype=torch.float64), "factor_decay": 0.0, "kl_clip": None}
    set_later = run(lambda step: initial if step is None else later if step == 1 else {})
    scheduled = run(lambda step: {} if step is not None else
                    {"damping": lambda s: 0.3 if s < 1 else 0.02, "factor_decay": lambda s: 0.95 if s < 1 else 0.0,
                     "kl_clip": lambda s: 1e-3 if s < 1 else None})
    torch.testing.assert_close(set_later, scheduled, rtol=0, atol=0)
    assert not torch.equal(set_later, run(lambda step: {}))


def test_a_bias_frozen_after_registration_does_not_move() -> None:
    """``zero_grad(set_to_none=False)`` leaves a frozen bias a zero gradient; the preconditioned gradient of its
    layer (one Kronecker block with the weight) had written a non-zero one there, and SGD moved it."""
    model = _mlp()
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for step in range(3):
        if step == 1:
            model[0].bias.requires_grad_(False)
            bias, weight = model[0].bias.detach().clone(), model[0].weight.detach().clone()
        sgd.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        pre.step()
        sgd.step()
    assert torch.equal(model[0].bias.grad, torch.zeros_like(bias)) and torch.equal(model[0].bias.detach(), bias)
    assert not torch.equal(model[0].weight.detach(), weight)
