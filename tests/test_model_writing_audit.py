"""How a model is written: layer subclasses replacing ``forward`` and user forward hooks on covered layers.

The reference is the float64 GGN / empirical Fisher of the model as it computes (``functional_call``
runs the user's hooks too), restricted to each covered module's parameters.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vmap

import curvature
from torchsso2 import SecondOrderOptimizer, VIOptimizer


class ScaledLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return 3 * super().forward(x)


class KeptLinear(nn.Linear):  # a custom initialisation; the layer's own forward
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)
        nn.init.orthogonal_(self.weight)


def _hooked_mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model[0].register_forward_hook(lambda mod, inp, out: 2 * out)  # the layer's output, doubled
    return model


def _data() -> tuple:
    g = torch.Generator().manual_seed(1)
    return torch.randn(7, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (7,), generator=g)


def _names(module: str) -> List[str]:
    return [f"{module}.weight", f"{module}.bias"]


def _ggn(model: nn.Module, x: Tensor, names: List[str]) -> Tensor:
    params = dict(model.named_parameters())

    def f(*ps: Tensor) -> Tensor:
        return functional_call(model, {**params, **dict(zip(names, ps))}, (x,))
    out = f(*[params[n] for n in names]).detach()
    jac = jacrev(f, argnums=tuple(range(len(names))))(*[params[n].detach() for n in names])
    n = out.shape[0]
    j = torch.cat([t.reshape(n, out.shape[1], -1) for t in jac], 2)
    p = out.softmax(-1)
    h = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("ncp,ncd,ndq->pq", j, h, j) / n


def _empirical(model: nn.Module, x: Tensor, y: Tensor, names: List[str]) -> Tensor:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(ps: Dict[str, Tensor], xn: Tensor, yn: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, {**params, **ps}, (xn[None],)), yn[None])
    g = vmap(grad(loss), in_dims=(None, 0, 0))({n: params[n] for n in names}, x, y)
    rows = torch.cat([g[n].reshape(x.shape[0], -1) for n in names], 1)
    return rows.T @ rows / x.shape[0]


@pytest.mark.parametrize("kind,approx", [("fisher", "full"), ("fisher", "diag"), ("empirical_fisher", "full")])
def test_a_forward_hook_changing_a_covered_layers_output_is_in_its_curvature(kind: str, approx: str) -> None:
    model, (x, y) = _hooked_mlp(), _data()
    result = curvature.compute(model, x, y, kind=kind, approx=approx)
    for module in ("0", "2"):
        ref = _ggn(model, x, _names(module)) if kind == "fisher" else _empirical(model, x, y, _names(module))
        if approx == "diag":
            ref = torch.diag(torch.diagonal(ref))
        torch.testing.assert_close(result.blocks[module].dense(), ref, rtol=1e-10, atol=1e-12)


def test_the_optimizer_step_of_a_hooked_layer_is_the_damped_newton_step() -> None:
    model, (x, y) = _hooked_mlp(), _data()
    opt = SecondOrderOptimizer(model, lr=1.0, momentum=0.0, approx="full", curvature="fisher", damping=0.1,
                               kl_clip=None, ema_decay=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def closure() -> tuple:
        opt.zero_grad()
        out = model(x)
        val = F.cross_entropy(out, y)
        val.backward()
        return val, out
    closure_grads: Dict[str, Tensor] = {}
    closure()
    closure_grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    refs = {m: _ggn(model, x, _names(m)) for m in ("0", "2")}
    opt.step(closure)
    for module, c in refs.items():
        g = torch.cat([closure_grads[n].reshape(-1) for n in _names(module)])
        expected = -torch.linalg.solve(c + 0.1 * torch.eye(c.shape[0], dtype=c.dtype), g)
        step = torch.cat([(dict(model.named_parameters())[n].detach() - before[n]).reshape(-1)
                          for n in _names(module)])
        torch.testing.assert_close(step, expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("face", ["compute", "second_order", "vi"])
def test_a_subclass_replacing_forward_is_refused_with_the_skip(face: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    build = {"compute": lambda m: curvature.compute(m, x, y),
             "second_order": lambda m: SecondOrderOptimizer(m),
             "vi": lambda m: VIOptimizer(m, dataset_size=6, approx="kfac")}[face]
    with pytest.raises(ValueError, match=r"ScaledLinear.forward overrides torch.nn.modules.linear.Linear.forward.*skip_modules=\['\^0\$'\]"):
        build(model)
    build(nn.Sequential(KeptLinear(4, 5), nn.Tanh(), nn.Linear(5, 3)))  # keeps Linear.forward: covered
    if face != "compute":  # the skip named in the message works
        opt = SecondOrderOptimizer(model, skip_modules=["^0$"]) if face == "second_order" \
            else VIOptimizer(model, dataset_size=6, approx="kfac", skip_modules=["^0$"])
        assert "0" not in opt.engine.layouts
    if face == "vi":  # VI's default diagonal needs only the gradients: it covers the module by its parameters
        assert VIOptimizer(model, dataset_size=6).engine.generic == ["0"]


def test_a_forward_set_on_the_instance_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    model[0].forward = lambda h: h[:, :3]
    with pytest.raises(ValueError, match="replaced on the instance"):
        SecondOrderOptimizer(model)


def test_a_scaled_subclass_would_be_wrong_which_is_why_it_is_refused() -> None:
    # the refusal guards a real error: the block of the plain layer's formula misses the factor 3² = 9
    torch.manual_seed(0)
    scaled = nn.Sequential(ScaledLinear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, _ = _data()
    ref = _ggn(scaled, x, _names("0"))
    plain = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    plain.load_state_dict(scaled.state_dict())
    plain[0].register_forward_hook(lambda mod, inp, out: 3 * out)  # the same function, as a hook
    y = torch.randint(0, 3, (7,))
    torch.testing.assert_close(curvature.compute(plain, x, y).blocks["0"].dense(), ref, rtol=1e-10, atol=1e-12)


def test_a_parametrized_root_module_gets_no_skip_hint_that_would_leave_nothing() -> None:
    model = nn.Linear(4, 3)
    nn.utils.parametrizations.orthogonal(model)
    with pytest.raises(ValueError, match="the model itself .*skipping it would leave no layer") as err:
        SecondOrderOptimizer(model)
    assert "skip_modules=" not in str(err.value)
    nested = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    nn.utils.parametrizations.orthogonal(nested[0])
    with pytest.raises(ValueError, match=r"skip_modules=\['\^0\$'\]"):
        SecondOrderOptimizer(nested)


class _StandardizedConv(nn.Conv2d):  # weight standardization through _conv_forward (BiT / timm style)
    def _conv_forward(self, x: Tensor, weight: Tensor, bias) -> Tensor:
        w = (weight - weight.mean((1, 2, 3), keepdim=True)) / (weight.std((1, 2, 3), keepdim=True) + 1e-5)
        return super()._conv_forward(x, w, bias)


def test_a_conv_subclass_replacing_conv_forward_is_refused() -> None:
    model = nn.Sequential(_StandardizedConv(1, 2, 3), nn.Flatten(), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"_StandardizedConv._conv_forward overrides .*Conv2d._conv_forward"):
        SecondOrderOptimizer(model)
