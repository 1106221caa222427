"""Fine-tuning patterns: a covered layer frozen after construction whose forward then runs under
torch.no_grad (all kinds and shapes), or under the Hessian; a body on another optimizer keeps its
gradient across adaptive damping's second closure call."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer


class _Scale(nn.Module):
    """``x · t`` for a parameter ``t`` the module does not own (a temperature in a plain param group)."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__()
        self.t = [t]  # not registered: the model's covered modules stay the model's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.t[0]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.body[0].weight.requires_grad:  # the usual frozen backbone: no graph through it
            with torch.no_grad():
                h = self.body(x)
        else:
            h = self.body(x)
        return self.head(h)


BUILDERS = {
    "kfac": lambda m: SecondOrderOptimizer(m),
    "diag": lambda m: SecondOrderOptimizer(m, approx="diag"),
    "empirical": lambda m: SecondOrderOptimizer(m, curvature="empirical_fisher"),
    "vi-kfac": lambda m: VIOptimizer(m, dataset_size=100, approx="kfac"),
    "hessian-full": lambda m: SecondOrderOptimizer(m, curvature="hessian", approx="full", damping=1.0),
    "hessian-diag": lambda m: SecondOrderOptimizer(m, curvature="hessian", approx="diag", damping=1.0),
}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_layer_frozen_after_construction_keeps_its_curvature_under_no_grad(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
    torch.manual_seed(0)
    model = _Net()
    opt = BUILDERS[name](model)
    kw = {"targets": y} if name.startswith("hessian") else {}

    closure = make_closure(opt, model, x, y)
    opt.step(closure, **kw)
    body = [p.detach().clone() for p in model.body.parameters()]
    block = [t.clone() for t in opt.running.blocks["body.0"].tensors()]
    model.body.requires_grad_(False)
    for _ in range(3):
        opt.step(closure, **kw)
    assert all(torch.equal(a, b) for a, b in zip(body, model.body.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(block, opt.running.blocks["body.0"].tensors()))
    model.body.requires_grad_(True)  # unfrozen: trains again from the kept curvature
    opt.step(closure, **kw)
    assert not all(torch.equal(a, b) for a, b in zip(body, model.body.parameters()))


def test_hessian_with_part_of_a_module_frozen_names_it() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = SecondOrderOptimizer(model, curvature="hessian", approx="full", damping=1.0)

    closure = make_closure(opt, model, x, y)
    opt.step(closure, targets=y)
    model[2].bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"module '2', and \['2.bias'\] do not require a gradient"):
        opt.step(closure, targets=y)


@pytest.mark.parametrize("zero_body", [False, True])
def test_adaptive_damping_leaves_another_optimizers_gradients_alone(zero_body: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    sgd = torch.optim.SGD(model[:4].parameters(), lr=0.1)
    opt = SecondOrderOptimizer(model, params=model[4].parameters(), adaptive_damping=True,
                               damping_adaptation_interval=1)

    def closure():
        opt.zero_grad()
        if zero_body:
            sgd.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out
    sgd.zero_grad()
    opt.step(closure)  # an LM step: the closure ran twice
    for p, q in zip(model[:4].parameters(), ref[:4].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["empirical_fisher", "fisher_mc", "hessian", "vi-kfac"])
def test_every_covered_module_frozen_takes_no_estimate_and_trains_the_plain_group(kind: str) -> None:
    """A temperature on the plain update trains alone: the frozen model keeps its curvature (the step
    had been refused as a non-finite output, or raised torch's "'inputs' argument to 'grad()' cannot be empty")."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = VIOptimizer(model, dataset_size=100, approx="kfac", on_nonfinite="raise") if kind == "vi-kfac" else \
        SecondOrderOptimizer(model, curvature=kind, on_nonfinite="raise", damping=1.0,
                             approx="full" if kind == "hessian" else "kfac")
    temperature = nn.Parameter(torch.ones(()))
    opt.add_param_group({"params": [temperature]})
    kw = {"targets": y} if kind == "hessian" else {}

    closure = make_closure(opt, nn.Sequential(model, _Scale(temperature)), x, y)
    opt.step(closure, **kw)
    model.requires_grad_(False)
    blocks = {n: [t.clone() for t in b.tensors()] for n, b in opt.running.blocks.items()}
    before = float(temperature.detach())
    for _ in range(3):
        opt.step(closure, **kw)
    assert opt.num_steps == 4 and opt.num_skipped == 0 and float(temperature.detach()) != before
    for n, ts in blocks.items():
        assert all(torch.equal(a, b) for a, b in zip(ts, opt.running.blocks[n].tensors()))


@pytest.mark.parametrize("face", ["second_order", "vi-kfac"])
def test_every_covered_module_frozen_before_the_first_step_names_it(face: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = SecondOrderOptimizer(model) if face == "second_order" else VIOptimizer(model, dataset_size=100, approx="kfac")
    temperature = nn.Parameter(torch.ones(()))
    opt.add_param_group({"params": [temperature]})
    model.requires_grad_(False)

    closure = make_closure(opt, nn.Sequential(model, _Scale(temperature)), x, y)
    with pytest.raises(ValueError, match="every covered module is frozen .* no curvature has been estimated yet"):
        opt.step(closure)
    assert opt.num_steps == 0
