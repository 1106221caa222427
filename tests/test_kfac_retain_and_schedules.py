"""KFACPreconditioner: two backward passes through one forward (``retain_graph=True``) fold that
forward's ``A`` once and each backward's ``G`` (kfac_pytorch's forward/backward hooks); a schedule
callable returning a bad value raises before the step changes anything."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2.kfac import KFACPreconditioner

DECAY = 0.8


def _build(**kw) -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = KFACPreconditioner(model, **{"factor_update_steps": 1, "inv_update_steps": 1, "damping": 0.01,
                                           "factor_decay": DECAY, **kw})
    return model, pre


def _two_losses(out: torch.Tensor, y: torch.Tensor) -> tuple:
    return F.cross_entropy(out, y), 0.5 * out.pow(2).mean()


@pytest.mark.parametrize("in_hook", [True, False])
def test_second_backward_adds_only_its_g(in_hook: bool) -> None:
    model, pre = _build(update_factors_in_hook=in_hook)
    x = torch.randn(8, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    hidden = model[1](model[0](x))
    out = model[2](hidden)
    # the output gradients of the last layer under each loss, and that layer's input
    losses = _two_losses(out, y)
    g1 = torch.autograd.grad(losses[0], out, retain_graph=True)[0]
    g2 = torch.autograd.grad(losses[1], out, retain_graph=True)[0]
    losses[0].backward(retain_graph=True)
    losses[1].backward()
    pre.step()

    layer = pre.layers["2"]
    a = torch.cat([hidden.detach(), torch.ones(8, 1, dtype=torch.float64)], 1)
    expected_a = DECAY * torch.eye(7, dtype=torch.float64) + (1 - DECAY) * a.T @ a / 8  # A folded once
    torch.testing.assert_close(layer.a_factor, expected_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.g_factor, _g_reference(g1, g2, in_hook), rtol=1e-12, atol=1e-12)


def _g_reference(g1: torch.Tensor, g2: torch.Tensor, in_hook: bool) -> torch.Tensor:
    n = g1.shape[0]
    eye = torch.eye(g1.shape[1], dtype=g1.dtype)
    b1, b2 = g1.T @ g1 / n, g2.T @ g2 / n
    if in_hook:
        return DECAY * (DECAY * eye + (1 - DECAY) * b1) + (1 - DECAY) * b2
    return DECAY * eye + (1 - DECAY) * (b1 + b2) / 2


def test_one_backward_per_forward_unchanged() -> None:
    """The usual loop: two micro-batches, one backward each (accumulation): A and G averaged."""
    model, pre = _build(accumulation_steps=2)
    xs = [torch.randn(8, 5, dtype=torch.float64) for _ in range(2)]
    hiddens = []
    for x in xs:
        hidden = model[1](model[0](x))
        hiddens.append(hidden.detach())
        model[2](hidden).pow(2).mean().backward()
    pre.step()
    eye = torch.eye(7, dtype=torch.float64)
    batches = [torch.cat([h, torch.ones(8, 1, dtype=torch.float64)], 1) for h in hiddens]
    expected = DECAY * eye + (1 - DECAY) * sum(b.T @ b / 8 for b in batches) / 2
    torch.testing.assert_close(pre.layers["2"].a_factor, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["damping", "kl_clip", "lr"])
def test_bad_schedule_value_raises_before_the_step_changes_anything(name: str) -> None:
    def schedule(step: int) -> float:
        return 0.01 if step == 0 else math.nan

    model, pre = _build(**{name: schedule})
    x = torch.randn(8, 5, dtype=torch.float64)
    model(x).pow(2).mean().backward()
    pre.step()
    factors = {n: (layer.a_factor.clone(), layer.g_factor.clone()) for n, layer in pre.layers.items()}
    model.zero_grad()
    model(torch.randn(8, 5, dtype=torch.float64)).pow(2).mean().backward()  # folded in the hooks
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=f"{name} must be .*nan.*returned by the callable at step 1"):
        pre.step()
    assert pre.steps == 1
    for n, layer in pre.layers.items():
        assert torch.equal(layer.a_factor, factors[n][0]) and torch.equal(layer.g_factor, factors[n][1])
        assert layer.a_batch is None and layer.g_batch is None
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_an_overflowing_first_backward_leaves_a_to_the_next() -> None:
    """With a grad_scaler the first backward through a forward overflows (skipped); the second, finite,
    backward through the same forward brings that forward's A and its own G."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, damping=0.01,
                                 factor_decay=DECAY, grad_scaler=lambda: 1.0)
    x = torch.randn(8, 5, dtype=torch.float64)
    out = model(x)
    hidden = model[1](model[0](x)).detach()
    (out[:, 0] * float("inf")).sum().backward(retain_graph=True)
    for p in model.parameters():
        p.grad = None
    out.pow(2).mean().backward()
    pre.step()
    a = torch.cat([hidden, torch.ones(8, 1, dtype=torch.float64)], 1)
    expected = DECAY * torch.eye(7, dtype=torch.float64) + (1 - DECAY) * a.T @ a / 8
    torch.testing.assert_close(pre.layers["2"].a_factor, expected, rtol=1e-12, atol=1e-12)


def test_an_overflowing_micro_batch_redone_folds_as_the_clean_run() -> None:
    """accumulation_steps=2; micro-batch 2's first backward overflows and is redone through the same forward:
    the factors equal the run without the overflow (the overflow counted for nothing)."""

    def run(overflow: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, damping=0.01,
                                     factor_decay=DECAY, grad_scaler=lambda: 1.0, accumulation_steps=2)
        gen = torch.Generator().manual_seed(3)
        for micro in range(2):
            out = model(torch.randn(8, 5, dtype=torch.float64, generator=gen))
            if overflow and micro == 1:
                (out[:, 0] * float("inf")).sum().backward(retain_graph=True)
                for p in model.parameters():
                    p.grad = None
            out.pow(2).mean().backward()
        pre.step()
        return pre.layers["2"].a_factor

    torch.testing.assert_close(run(True), run(False), rtol=1e-12, atol=1e-12)
