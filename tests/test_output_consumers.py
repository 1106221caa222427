"""An optimizer built on a submodule whose output the rest of the model turns into the loss's output
(:mod:`torchsso2.optim.output_consumers`): a warning naming the weights and the fix under every loss,
none where the optimizer takes the whole model (``params=``), where only parameters of one dimension
follow the output, where other terms are added to or subtracted from the output's path (regularisers,
distillation targets, a PINN's residual), or where the curvature comes from the user's backward alone
and nothing predicts."""
from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.optim.output_consumers import weights_after

PATTERN = r"output of the model it was built on \(Sequential, shape \[16, 3\]\) reaches the closure's loss"


class Net(nn.Module):
    def __init__(self, out: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        self.head = nn.Linear(3, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _data(loss: str):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=gen)
    if loss == "cross_entropy":
        return x, torch.randint(0, 3, (16,), generator=gen), F.cross_entropy
    if loss == "mse":
        return x, torch.randn(16, 3, generator=gen), lambda o, y: 0.5 * (o - y).pow(2).sum(1).mean()
    return x, torch.randint(0, 2, (16, 3), generator=gen).float(), \
        lambda o, y: F.binary_cross_entropy_with_logits(o, y, reduction="sum") / o.shape[0]


def _steps(opt: Any, net: nn.Module, x: torch.Tensor, y: torch.Tensor, fn: Callable, **kw: Any) -> None:
    def closure():
        opt.zero_grad()
        loss = fn(net(x), y)
        loss.backward()
        return loss
    for _ in range(2):
        opt.step(closure, **kw)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse", "binary_cross_entropy"])
@pytest.mark.parametrize("face", ["fisher_mc", "fisher", "hessian", "vi_kfac"])
def test_a_submodule_under_a_head_is_named_under_every_loss(loss: str, face: str) -> None:
    torch.manual_seed(0)
    net = Net()
    x, y, fn = _data(loss)
    if face == "vi_kfac":
        opt = VIOptimizer(net.body, dataset_size=64, approx="kfac", loss=loss)
    else:
        opt = SecondOrderOptimizer(net.body, curvature=face, approx="diag", loss=loss, damping=1.0)
    kw = {"targets": y} if face == "hessian" else {}
    with pytest.warns(UserWarning) as rec:
        _steps(opt, net, x, y, fn, **kw)
    named = [str(r.message) for r in rec if "reaches the closure's loss" in str(r.message)]
    assert len(named) == 1, [str(r.message) for r in rec]  # once, and in place of the softmax check's
    assert not any("softmax(output)" in str(r.message) for r in rec), [str(r.message) for r in rec]
    assert "parameters of shape [3, 3]" in named[0] and "params=backbone.parameters()" in named[0], named[0]
    assert "the curvature is taken as if this output were the one the likelihood" in named[0], named[0]


def test_vi_default_diagonal_is_told_only_about_predict() -> None:
    torch.manual_seed(0)
    net = Net()
    x, y, fn = _data("mse")
    opt = VIOptimizer(net.body, dataset_size=64, loss="mse")
    with pytest.warns(UserWarning, match="its curvature is right .* but predict\\(\\) averages this output") as rec:
        _steps(opt, net, x, y, fn)
    assert "If you do not call predict(), ignore this" in str(rec[0].message)


@pytest.mark.parametrize("case", ["whole_model_params", "empirical_fisher_from_backward", "one_dim_parameters",
                                  "frozen_head", "regulariser_on_other_weights", "distillation_target", "pinn",
                                  "gradient_penalty", "temperature_1x1"])
def test_no_warning(case: str) -> None:
    torch.manual_seed(0)
    net = Net()
    x, y, fn = _data("mse")
    other, teacher = nn.Linear(4, 3), nn.Linear(4, 3)
    if case == "whole_model_params":
        opt = SecondOrderOptimizer(net, params=net.body.parameters(), loss="mse")
    elif case == "empirical_fisher_from_backward":  # the curvature of the loss as written (a GAN generator's)
        opt = SecondOrderOptimizer(net.body, curvature="empirical_fisher", loss="mse")
    elif case == "frozen_head":  # (not seen: a frozen weight leaves no trace in the loss's graph)
        net.head.requires_grad_(False)
        opt = SecondOrderOptimizer(net.body, loss="mse")
    elif case == "regulariser_on_other_weights":  # an added term: the likelihood of the output is the same
        body = net.body
        fn = lambda o, t: 0.5 * (o - t).pow(2).sum(1).mean() + 1e-3 * other.weight.norm()  # noqa: E731
        net = body
        opt = SecondOrderOptimizer(body, loss="mse")
    elif case == "distillation_target":  # a Gaussian likelihood around a trained teacher's output
        body = net.body
        fn = lambda o, t: 0.5 * (o - teacher(x)).pow(2).sum(1).mean()  # noqa: E731
        net = body
        opt = SecondOrderOptimizer(body, loss="mse")
    elif case == "pinn":  # an input that requires grad, subtracted from the output
        body = net.body
        x = x.clone().requires_grad_(True)
        fn = lambda o, t: 0.5 * (o - torch.sin(x[:, :3])).pow(2).sum(1).mean()  # noqa: E731
        net = body
        opt = SecondOrderOptimizer(body, loss="mse")
    elif case == "gradient_penalty":  # the loss takes a derivative of the output: no likelihood of it alone
        x = x.clone().requires_grad_(True)
        body = net = net.body

        def fn(o, t):
            nll = 0.5 * (o - t).pow(2).sum(1).mean()
            (gx,) = torch.autograd.grad(o.sum(), x, create_graph=True)
            return nll + 1e-3 * gx.pow(2).sum()
        opt = SecondOrderOptimizer(body, loss="mse", curvature="empirical_fisher", approx="diag",
                                   use_adaptive_learning_rate=True)
    elif case == "temperature_1x1":  # a scale, whatever its shape
        temp = nn.Parameter(torch.ones(1, 1))
        body = net.body
        net = nn.Module()
        net.forward = lambda inp: body(inp) / temp  # type: ignore[method-assign]
        opt = SecondOrderOptimizer(body, loss="mse")
    else:  # a learned per-output scale and temperature after the model: not a layer
        scale, temp = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(()))
        body = net.body
        net = nn.Module()
        net.forward = lambda inp: body(inp) * scale / temp  # type: ignore[method-assign]
        opt = SecondOrderOptimizer(body, loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(opt, net, x, y, fn)


def test_a_tied_head_applied_outside_the_model_is_named() -> None:
    """``F.linear(h, trunk.weight)`` after the model's forward (a tied LM head written outside it): the
    weight is the model's own, and still transforms the output on its way to the loss."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    x, y = torch.randn(16, 3), torch.randint(0, 3, (16,))
    opt = SecondOrderOptimizer(trunk, loss="mse")
    targets = F.one_hot(y, 3).float()
    with pytest.warns(UserWarning, match=r"through the model's own weights \(parameters of shape \[3, 3\]\): .*"
                                         r"The model is run on its own output.*a tied head a module of it"):
        _steps(opt, lambda inp: F.linear(trunk(inp), trunk[0].weight), x, targets,
               lambda o, t: 0.5 * (o - t).pow(2).sum(1).mean())


def test_weights_after_walks_only_what_transforms_the_output() -> None:
    """A weight on another branch into the loss (an auxiliary term on the inputs) is not on the path from
    the output: not named; a weight applied after the output is, once."""
    torch.manual_seed(0)
    body, head, aux = nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(4, 1)
    x = torch.randn(8, 4)
    out = body(x)
    loss = head(out).pow(2).mean() + aux(x).pow(2).mean()
    assert [tuple(w.shape) for w in weights_after(loss, out)] == [(2, 3)]
    assert weights_after(out.sum(), out) == []  # nothing after the output
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (a cast between the weight and the product)
        assert [tuple(w.shape) for w in weights_after(head(out).float().pow(2).mean(), out)] == [(2, 3)]
    assert [tuple(w.shape) for w in weights_after(torch.einsum("nc,kc->nk", out, head.weight).sum(), out)] == [(2, 3)]


def test_reparametrised_heads_are_seen() -> None:
    """A cosine, weight-normalised or LoRA-adapted head: the weight reaches the product through its own
    reparametrisation."""
    torch.manual_seed(0)
    body = nn.Linear(3, 5)
    out = body(torch.randn(4, 3))
    w, a, b = nn.Parameter(torch.randn(7, 5)), nn.Parameter(torch.randn(7, 2)), nn.Parameter(torch.randn(2, 5))
    wn = nn.utils.parametrizations.weight_norm(nn.Linear(5, 7))
    for loss in (F.linear(F.normalize(out), F.normalize(w)).sum(), F.linear(out, w + a @ b).sum(), wn(out).sum()):
        assert [tuple(t.shape) for t in weights_after(loss, out)] == [(7, 5)]
