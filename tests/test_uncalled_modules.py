"""Covered modules a step does not call, or calls on no rows (conditional computation: LayerDrop, a
mixture of experts, a head some steps use), in SecondOrderOptimizer's curvature capture.

* Called on no rows (an expert nothing was routed to, called anyway): a ValueError naming the modules
  and the fix (skip such a call). Before, a RuntimeError from a reshape inside the forward hook.
* Not called, with several processes: a ValueError that says the reason is the processes (the ranks'
  fresh blocks are averaged by position) and names the two ways out (skip_modules, KFACPreconditioner).
  Before, the one-process message, which suggested freezing them and reentrant checkpointing.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import torchrun_script
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


SCRIPT = """
import sys
import torch, torch.distributed as dist
from torch import nn
from torchsso2 import SecondOrderOptimizer
dist.init_process_group("gloo")
torch.manual_seed(0)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.extra = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(8, 3)
    def forward(self, x, use_extra):
        h = torch.tanh(self.body(x))
        return self.head(h) + (self.extra(h) if use_extra else 0)

model = nn.parallel.DistributedDataParallel(Net(), find_unused_parameters=True)
opt = SecondOrderOptimizer(model, approx="kfac")
x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
def closure(use_extra):
    def run():
        opt.zero_grad(); out = model(x, use_extra); loss = nn.functional.cross_entropy(out, y); loss.backward()
        return loss, out
    return run
opt.step(closure(True))
try:
    opt.step(closure(False))  # every rank skips the extra head at this step
except ValueError as err:
    with open(f"{sys.argv[1]}/rank{dist.get_rank()}.txt", "w") as f:  # (the ranks' stdout lines interleave)
        f.write(str(err))
dist.destroy_process_group()
"""


def test_a_module_not_called_with_several_processes_names_the_reason(tmp_path):
    code, out = torchrun_script(tmp_path, "uncalled.py", SCRIPT, str(tmp_path))
    assert code == 0, out
    raised = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2) if (tmp_path / f"rank{r}.txt").exists()]
    assert len(raised) == 2, out
    for line in raised:
        assert "covered modules ['module.extra'] were not called at this curvature step: with several processes " \
               "(2 here)" in line and "skip_modules" in line and "KFACPreconditioner" in line, line
        assert "freeze" not in line and "reentrant" not in line.lower(), line


def test_the_hessian_takes_a_module_called_on_no_rows():
    """kind="hessian" differentiates the loss itself: an expert called on no rows has a zero block there, as
    before (the no-rows refusal is for the kinds that read the recorded rows)."""
    model = Experts()
    torch.manual_seed(1)
    x, y = torch.randn(3, 4), torch.randint(0, 3, (3,))
    opt = SecondOrderOptimizer(model, approx="full", curvature="hessian")
    opt.step(make_closure(opt, model, x, y), targets=y)
    assert opt.num_steps == 1


class ParentUsesWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.proj = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(torch.tanh(self.body(x)), self.proj.weight, self.proj.bias)


class SkippedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.extra = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize("kind", ["fisher_mc", "empirical_fisher"])
def test_the_several_processes_reason_is_given_only_for_modules_the_loss_does_not_use(kind):
    """The hint (as the optimizers set it with several processes) is for a module the step skipped; a module
    whose weight a parent uses without calling it keeps the general message (skip the parent, or freeze)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    for model, expected in ((SkippedHead(), "HINT"), (ParentUsesWeight(), "skip the parent")):
        opt = SecondOrderOptimizer(model, approx="kfac", curvature=kind)
        opt.engine.allow_uncalled, opt.engine.uncalled_hint = False, "HINT"  # what world_size > 1 sets
        with pytest.raises(ValueError, match=expected):
            opt.step(make_closure(opt, model, x, y))


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
