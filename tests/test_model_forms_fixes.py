"""Models written in less common ways: a forward hook registered before KFACPreconditioner, a
parametrized layer under it, another nn.Parameter swapped in by functional_call, the Hessian with
the optimizer on the original module and a compiled closure."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import torchsso2
from torchsso2.kfac import KFACPreconditioner


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _g_factor(order: str, hook) -> torch.Tensor:
    x, y = _data()
    model = _mlp()
    if order == "before":
        model[0].register_forward_hook(hook)
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, factor_decay=1e-12)
    if order == "after":
        model[0].register_forward_hook(hook)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    return pre.layers["0"].g_factor.clone()


@pytest.mark.parametrize("hook", [lambda m, i, o: 2 * o, lambda m, i, o: torch.sinh(o) + o])
def test_kfac_preconditioner_g_is_of_the_layers_own_output_whatever_the_hook_order(hook) -> None:
    torch.testing.assert_close(_g_factor("before", hook), _g_factor("after", hook), rtol=1e-6, atol=1e-9)


def test_kfac_preconditioner_names_a_parametrized_layer_it_leaves_out() -> None:
    model = _mlp()
    torch.nn.utils.parametrizations.weight_norm(model[0])
    with pytest.warns(UserWarning, match="'0' .*parametrized"):
        pre = KFACPreconditioner(model)
    assert "0" not in pre.layers and "2" in pre.layers
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = KFACPreconditioner(model, skip_layers=["^0$"])
    assert list(pre.layers) == ["2"]


@pytest.mark.parametrize("kind,approx", [("fisher", "full"), ("fisher_mc", "kfac"), ("fisher_mc", "diag"),
                                         ("empirical_fisher", "diag")])
def test_another_parameter_swapped_in_by_functional_call_is_refused(kind: str, approx: str) -> None:
    x, y = _data()
    model = _mlp()
    ema = copy.deepcopy(model)
    opt = torchsso2.SecondOrderOptimizer(model, curvature=kind, approx=approx, damping=1.0)

    def closure():
        opt.zero_grad()
        out = functional_call(model, {"2.weight": ema[2].weight}, (x,))
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out
    with pytest.raises(ValueError, match=r"ran with other tensors in place of its parameters \['2.weight'\]"):
        opt.step(closure)

    def own():  # the model's own parameters through functional_call: as a plain call
        opt.zero_grad()
        out = functional_call(model, dict(model.named_parameters()), (x,))
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out
    opt.step(own)
    assert opt.num_steps == 1


def test_hessian_with_the_optimizer_on_the_original_module_and_a_compiled_closure() -> None:
    x, y = _data()
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = _mlp()
        opt = torchsso2.SecondOrderOptimizer(model, curvature="hessian", approx="full", damping=1.0)
        call = torch.compile(model, backend="eager") if compiled else model

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(call(x), y)
            loss.backward()
            return loss
        for _ in range(2):
            opt.step(closure, targets=y)
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch._dynamo.reset()
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-7)
