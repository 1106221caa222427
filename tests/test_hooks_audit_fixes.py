"""User hooks and the curvature: gradient hooks on a covered layer's output tensor, global forward hooks,
hooks on nn.MultiheadAttention's out_proj."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer
from torchsso2.kfac import KFACPreconditioner


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def _ef_from_backward(transform: str):
    model, (x, y) = _mlp(), _data()
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher", approx="full", ema_decay=0.0)

    def closure():
        opt.zero_grad()
        out = model(x)
        if transform == "hook":  # on the last Linear's own output tensor
            out.register_hook(lambda g: 2 * g)
        loss = F.cross_entropy(out, y) * (2.0 if transform == "scale" else 1.0)
        loss.backward()
        return loss, out
    opt.step(closure)
    return {n: b.dense() for n, b in opt.running.blocks.items()}


def test_a_gradient_hook_on_the_output_is_in_the_empirical_fisher_of_every_layer() -> None:
    plain, hooked, scaled = _ef_from_backward("none"), _ef_from_backward("hook"), _ef_from_backward("scale")
    for name in plain:  # out.register_hook(2·g) is the loss times 2: every block times 4
        torch.testing.assert_close(hooked[name], 4 * plain[name])
        torch.testing.assert_close(hooked[name], scaled[name])


def _kfac_g(hook: bool):
    model, (x, y) = _mlp(), _data()
    model = model.float()
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, factor_decay=1e-6)
    out = model(x.float())
    if hook:
        out.register_hook(lambda g: 2 * g)
    F.cross_entropy(out, y).backward()
    pre.step()
    return {n: layer.g_factor.clone() for n, layer in pre.layers.items()}


def test_kfac_preconditioner_sees_a_hook_on_the_last_output_at_every_layer_as_kfac_pytorch() -> None:
    plain, hooked = _kfac_g(False), _kfac_g(True)
    for name in plain:  # kfac_pytorch's backward hooks see 2·g at every layer: G × 4 (the EMA keeps 1e-6 of I)
        torch.testing.assert_close(hooked[name], 4 * plain[name], rtol=1e-4, atol=1e-5)


def test_a_global_forward_hook_is_warned_about() -> None:
    model, (x, y) = _mlp(), _data()
    opt = SecondOrderOptimizer(model)

    closure = make_closure(opt, model, x, y)
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        with pytest.warns(UserWarning, match="global forward hook"):
            opt.step(closure)
    finally:
        handle.remove()


class _Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d, 4, batch_first=True)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("width", [16, 512])  # 512: the low-rank solver records out_proj too (its hooks are ours)
def test_hooks_on_out_proj_are_refused_and_the_captures_own_are_not(width: int) -> None:
    torch.manual_seed(0)
    model = _Attention(width)
    x, y = torch.randn(4, 5, width), torch.randint(0, 3, (4,))
    opt = SecondOrderOptimizer(model)

    closure = make_closure(opt, model, x, y)
    opt.step(closure)
    opt.step(closure)
    model.mha.out_proj.register_forward_hook(lambda m, i, o: 2 * o)  # fires only in a recorded forward
    with pytest.raises(ValueError, match="out_proj has hooks of yours.*skip_modules=\\['\\^mha\\$'\\]"):
        opt.step(closure)
