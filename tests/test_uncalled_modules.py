"""Covered modules a step does not call, or calls on no rows (conditional computation: LayerDrop, a
mixture of experts, a head some steps use), in SecondOrderOptimizer's curvature capture.

* Called on no rows (an expert nothing was routed to, called anyway): a ValueError naming the modules
  and the fix (skip such a call). Before, a RuntimeError from a reshape inside the forward hook.
* Not called by some parts of the batch (micro-batches, ranks): tests/test_routed_modules.py.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models import Experts
from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer


@pytest.mark.parametrize("approx,kind", [("kfac", "fisher_mc"), ("diag", "fisher_mc"), ("kfac", "empirical_fisher")])
def test_a_module_called_on_no_rows_is_named_with_the_fix(approx, kind):
    model = Experts()
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    pick = model.gate(x).argmax(1)
    unused = [k for k in range(3) if not (pick == k).any()]
    assert unused, "the batch routes to every expert; pick another seed"
    opt = SecondOrderOptimizer(model, approx=approx, curvature=kind)
    with pytest.raises(ValueError, match=rf"covered modules \['experts.{unused[0]}'.*\] were called on no rows .*"
                                         r"skip such a call"):
        opt.step(make_closure(opt, model, x, torch.randint(0, 3, (3,))))


def test_the_hessian_takes_a_module_called_on_no_rows():
    """kind="hessian" differentiates the loss itself: an expert called on no rows has a zero block there, as
    before (the no-rows refusal is for the kinds that read the recorded rows)."""
    model = Experts()
    torch.manual_seed(1)
    x, y = torch.randn(3, 4), torch.randint(0, 3, (3,))
    opt = SecondOrderOptimizer(model, approx="full", curvature="hessian")
    opt.step(make_closure(opt, model, x, y), targets=y)
    assert opt.num_steps == 1


def test_the_diagonal_hessian_of_a_module_called_on_no_rows_equals_brute_force():
    """The fast diagonal path of Linear/Conv2d indexed the first row of the output: an expert called on no
    rows raised an IndexError. It now takes the general path (its block is zero), equal to torch.func's
    Hessian diagonal in float64."""
    import curvature
    from torch.func import functional_call, hessian

    model = Experts().double()
    torch.manual_seed(1)
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
    got = torch.cat([t.reshape(-1) for t in curvature.compute(model, x, y, kind="hessian", approx="diag").diagonal()])
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]

    def loss(*ps):
        return nn.functional.cross_entropy(functional_call(model, dict(zip(names, ps)), (x,)), y)

    h = hessian(loss, argnums=tuple(range(len(params))))(*params)
    want = torch.cat([torch.diagonal(h[i][i].reshape(p.numel(), p.numel())) for i, p in enumerate(params)])
    assert torch.allclose(got, want, rtol=0, atol=1e-14) and bool((got == 0).any())
    opt = SecondOrderOptimizer(model, approx="diag", curvature="hessian")
    opt.step(make_closure(opt, model, x, y), targets=y)
    assert opt.num_steps == 1
