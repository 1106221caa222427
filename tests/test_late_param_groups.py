"""Layers whose parameters join an optimizer after it was built (add_param_group: a head appended
to the model, a layer unfrozen for fine-tuning) take the plain update, as before, and now say so
with a UserWarning naming them (torchsso2/optim/late_groups.py); a checkpoint loaded before such a
group is added no longer breaks the next step (torch's load_state_dict adds
defaults['differentiable'], which add_param_group copied into the new group and the step refused)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer

X, Y = torch.randn(32, 8), torch.randint(0, 2, (32,))


def _build(face: str, model: nn.Module, **kw):
    if face == "sso":
        return SecondOrderOptimizer(model, lr=0.01, kl_clip=None, **kw)
    return VIOptimizer(model, dataset_size=32, **kw)


def _closure(opt, model):
    return make_closure(opt, model, X, Y)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_an_unfrozen_layer_added_later_warns_and_takes_the_plain_update(face):
    model = _mlp()
    model[0].requires_grad_(False)
    opt = _build(face, model)
    opt.step(_closure(opt, model))
    model[0].requires_grad_(True)
    with pytest.warns(UserWarning, match=r"add_param_group: modules \['0'\] have curvature support but were not "
                                         r"covered when this (SecondOrderOptimizer|VIOptimizer) was built") as rec:
        opt.add_param_group({"params": model[0].parameters()})
    assert rec[0].filename == __file__  # points at the user's call
    assert sorted(opt.engine.layouts) == ["2"]  # coverage stays as built
    if face == "sso":  # the plain update: lr · gradient (no momentum buffer yet for the new group, kl_clip off)
        w = model[0].weight.detach().clone()
        opt.step(_closure(opt, model))
        torch.testing.assert_close(w - model[0].weight.detach(), 0.01 * model[0].weight.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_a_head_appended_to_the_model_warns(face):
    model = _mlp()
    opt = _build(face, model)
    model.append(nn.Linear(3, 2))
    with pytest.warns(UserWarning, match=r"modules \['3'\] have curvature support"):
        opt.add_param_group({"params": model[3].parameters()})
    opt.step(_closure(opt, model))  # and trains


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_no_warning_for_skipped_modules_uncovered_types_and_the_constructor(face):
    model = _mlp()
    model.append(nn.Linear(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = _build(face, model, skip_modules=["^3$"], params=list(model[:3].parameters()))
        opt.add_param_group({"params": model[3].parameters()})  # skipped by the optimizer's own skip_modules
        scale = nn.Parameter(torch.ones(()))  # a parameter of no layer: nothing would cover it
        opt.add_param_group({"params": [scale]})


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_a_group_added_after_load_state_dict_steps(face):
    """torch's load_state_dict calls __setstate__, which sets defaults['differentiable'] = False; a group
    added afterwards got it and every later step raised 'keys ['differentiable'] are options ... does
    not have per group'."""
    model = _mlp()
    opt = _build(face, model)
    closure = _closure(opt, model)
    opt.step(closure)
    opt.load_state_dict(opt.state_dict())
    assert "differentiable" not in opt.defaults
    model.append(nn.Linear(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the new head takes the plain update (tested above)
        opt.add_param_group({"params": model[3].parameters()})
    assert "differentiable" not in opt.param_groups[-1]
    opt.step(closure)
    opt.load_state_dict(opt.state_dict())  # and the checkpoint with the new group loads
    opt.step(closure)


def test_parameters_of_covered_modules_added_later_are_named_as_parameters():
    """A no-decay group added after construction (biases of covered Linears, a LayerNorm): the
    LayerNorm is a module the optimizer does not cover, the biases are uncovered parameters of
    modules it covers; each gets its own message."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    opt = SecondOrderOptimizer(model, params=[model[0].weight, model[2].weight], lr=0.1)
    with pytest.warns(UserWarning) as rec:
        opt.add_param_group({"params": [model[0].bias, model[1].weight, model[1].bias, model[2].bias],
                             "weight_decay": 0.0})
    messages = [str(r.message) for r in rec]
    assert len(messages) == 2, messages
    assert messages[0].startswith("add_param_group: modules ['1'] have curvature support but were not covered")
    assert messages[1].startswith("add_param_group: parameters ['0.bias', '2.bias'] of modules this "
                                  "SecondOrderOptimizer covers were not in its params")


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_a_layer_unfrozen_without_add_param_group_is_named(face):
    """Built on the model's trainable parameters, an optimizer leaves a frozen layer out of its groups
    (as torch.optim does with filter(requires_grad)): unfrozen later, its gradients are never applied,
    which was silent. Now a UserWarning, once, naming the parameters and add_param_group."""
    model = _mlp()
    model[0].requires_grad_(False)
    opt = _build(face, model)
    opt.step(_closure(opt, model))
    model[0].requires_grad_(True)
    w = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match=r"parameters \['0.weight', '0.bias'\] were frozen \(requires_grad=False\) "
                                         r"when this \w+ was built and are trainable now: they are not in its param "
                                         r"groups .* does not update them\. Modules \['0'\] have curvature support"
                      ) as rec:
        opt.step(_closure(opt, model))
    assert [r.filename for r in rec] == [__file__]  # once, at the user's call
    assert torch.equal(model[0].weight.detach(), w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        opt.step(_closure(opt, model))


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_a_frozen_layer_listed_in_params_takes_the_plain_update_when_unfrozen_and_says_so(face):
    model = _mlp()
    model[0].requires_grad_(False)
    opt = _build(face, model, params=model.parameters())  # as torch.optim: the frozen layer in the groups
    opt.step(_closure(opt, model))
    model[0].requires_grad_(True)
    w = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match=r"parameters \['0.weight', '0.bias'\] were frozen .* they take the plain "
                                         r"update \((momentum SGD, no curvature|their mean as a point estimate)"):
        opt.step(_closure(opt, model))
    assert not torch.equal(model[0].weight.detach(), w)
    assert sorted(opt.engine.layouts) == ["2"]


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_no_unfrozen_warning_after_add_param_group_or_for_a_layer_left_out_of_params(face):
    model = _mlp()
    model[0].requires_grad_(False)
    opt = _build(face, model)
    model[0].requires_grad_(True)
    with pytest.warns(UserWarning, match="add_param_group: modules"):  # the documented route warns there
        opt.add_param_group({"params": model[0].parameters()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(_closure(opt, model))
        other = _mlp()
        other[0].requires_grad_(False)
        mine = _build(face, other, params=other[2].parameters())  # the user's choice of parameters
        other[0].requires_grad_(True)
        mine.step(_closure(mine, other))


class _Scaled(nn.Module):
    """A container holding a parameter itself (a learned temperature)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.mark.parametrize("approx", ["diag", "kfac"])
def test_a_containers_own_parameter_added_later_is_named_with_a_way_that_works(approx):
    """README's recipe (the container's own parameters by add_param_group): VIOptimizer's default diagonal
    could have covered them, and says how (not skip_modules, which would skip the whole container)."""
    model = _Scaled()
    opt = VIOptimizer(model, dataset_size=32, approx=approx, params=model.lin.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.add_param_group({"params": [model.scale]})
    messages = [str(w.message) for w in caught]
    if approx == "kfac":  # no layer family describes the container: the plain update is all there is
        assert messages == []
    else:
        assert len(messages) == 1 and messages[0].startswith("add_param_group: parameters ['scale'] take the plain")
        assert "list them in the constructor's params" in messages[0] and "skip_modules" not in messages[0]
    before = model.scale.detach().clone()
    opt.step(_closure(opt, model))
    assert not torch.equal(model.scale, before)  # it trains (the plain update)
