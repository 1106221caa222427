"""Param groups as torch.optim takes them: named parameters, NumPy hyperparameters, duplicates and other
optimizers' group options, an empty list; a no-grad model call inside an adaptive closure."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, generator=g), torch.randint(0, 2, (8,), generator=g)


def _run(params_of, **kw) -> torch.Tensor:
    model = _model()
    x, y = _data()
    opt = SecondOrderOptimizer(model, params=params_of(model), **kw)
    for _ in range(2):
        opt.step(make_closure(opt, model, x, y))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_named_parameters_are_taken_as_torch_optim_takes_them() -> None:
    plain = _run(lambda m: m.parameters())
    torch.testing.assert_close(_run(lambda m: m.named_parameters()), plain, rtol=0, atol=0)
    torch.testing.assert_close(_run(lambda m: [{"params": list(m.named_parameters())}]), plain, rtol=0, atol=0)
    model = _model()
    assert len(VIOptimizer(model, dataset_size=8, params=model.named_parameters()).param_groups[0]["params"]) == 4


def _torch_optim_takes_names() -> bool:
    try:
        torch.optim.SGD([("w", nn.Parameter(torch.zeros(1)))], lr=0.1)  # torch >= 2.6
    except TypeError:
        return False
    return True


@pytest.mark.skipif(not _torch_optim_takes_names(), reason="this torch.optim takes no named parameters (torch < 2.6)")
@pytest.mark.parametrize("cls", [SecondOrderOptimizer, VIOptimizer])
def test_named_parameters_keep_their_names_as_in_torch_optim(cls, tmp_path) -> None:
    model = _model()
    x, y = _data()
    make = (lambda params: cls(model, params=params)) if cls is SecondOrderOptimizer else \
        (lambda params: cls(model, dataset_size=8, params=params))
    opt = make(model.named_parameters())
    opt.step(make_closure(opt, model, x, y))
    reference = torch.optim.SGD(model.named_parameters(), lr=0.1)
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert opt.param_groups[0]["param_names"] == reference.param_groups[0]["param_names"] == names
    assert opt.state_dict()["param_groups"][0]["param_names"] == names  # torch's key for matching state to a model
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    again = make(model.named_parameters())
    again.load_state_dict(torch.load(tmp_path / "opt.pt"))  # weights_only=True, torch's default
    assert again.param_groups[0]["param_names"] == names
    groups = make([{"params": model[0].named_parameters()}, {"params": model[2].named_parameters(), "lr": 0.25}])
    assert [g["param_names"] for g in groups.param_groups] == [["weight", "bias"]] * 2
    # torch.optim's rules: a group names all its parameters or none, and all groups alike
    with pytest.raises(ValueError, match="Some param names are missing"):
        make([("0.weight", model[0].weight), model[0].bias])
    with pytest.raises(ValueError, match="with/without names"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    opt.add_param_group({"params": [("extra", nn.Parameter(torch.zeros(2)))]})
    assert opt.param_groups[-1]["param_names"] == ["extra"]


def test_numpy_float_hyperparameters_are_their_values() -> None:
    plain = _run(lambda m: m.parameters(), lr=0.5, momentum=0.25)  # exact in float32 and float64
    torch.testing.assert_close(_run(lambda m: m.parameters(), lr=np.float32(0.5), momentum=np.float32(0.25)), plain,
                               rtol=0, atol=0)
    model = _model()
    x, y = _data()
    opt = SecondOrderOptimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: np.float32(0.5))  # a float32 schedule array
    opt.step(make_closure(opt, model, x, y))
    sched.step()
    assert isinstance(opt.param_groups[0]["lr"], np.floating)  # (np.float32 with NumPy 2, np.float64 with 1.x)
    opt.step(make_closure(opt, model, x, y))  # refused before: "must be a real number, got float32"
    assert type(opt.param_groups[0]["lr"]) is float
    with pytest.raises(TypeError, match="lr must be a real number"):
        SecondOrderOptimizer(_model(), lr=np.bool_(True))


def test_a_parameter_listed_twice_is_refused() -> None:
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning about duplicates
        with pytest.raises(ValueError, match="lists a parameter more than once"):
            SecondOrderOptimizer(model, params=[model[0].weight, *model.parameters()])


@pytest.mark.parametrize("key", ["maximize", "nesterov", "damping"])
def test_other_optimizers_group_options_are_refused_not_ignored(key: str) -> None:
    model = _model()
    with pytest.raises(ValueError, match=rf"\['{key}'\] are options SecondOrderOptimizer does not have per group "
                                         r"\(options of other torch.optim optimizers"):
        SecondOrderOptimizer(model, params=[{"params": model.parameters(), key: True}])
    opt = SecondOrderOptimizer(model, params=[{"params": model.parameters(), "name": "body"}])  # metadata is fine
    assert opt.param_groups[0]["name"] == "body"


def test_an_empty_parameter_list_says_so() -> None:
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        SecondOrderOptimizer(_model(), params=iter([]))


def test_a_no_grad_model_call_in_an_adaptive_closure_is_not_in_the_quadratic_model() -> None:
    x, y = _data()
    other = torch.randn(16, 3)
    alphas = []
    for extra in (False, True):
        model = _model().double()
        opt = SecondOrderOptimizer(model, use_adaptive_learning_rate=True, curvature="fisher", approx="full")

        def closure():
            opt.zero_grad()
            if extra:
                with torch.no_grad():
                    model(other.double())  # a metric on other inputs
            out = model(x.double())
            loss = F.cross_entropy(out, y)
            loss.backward()
            return loss, out
        opt.step(closure)
        alphas.append(opt.adaptive.last["learning_rate"])
    assert alphas[1] == pytest.approx(alphas[0], rel=1e-12)


def test_named_parameters_in_add_param_group_and_sets_refused_as_torch_does() -> None:
    model = _model()
    opt = SecondOrderOptimizer(model, params=model[0].named_parameters())
    opt.add_param_group({"params": model[2].named_parameters()})
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    with pytest.raises(TypeError, match="ordered collections"):
        SecondOrderOptimizer(_model()).add_param_group({"params": {torch.nn.Parameter(torch.zeros(2))}})
