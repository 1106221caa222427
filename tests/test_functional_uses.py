"""A covered parameter used outside the module calls the curvature records (curvature/uses.py).

A functional tied head ``F.linear(h, emb.weight)`` adds a path from ``emb.weight`` to the loss that
no record sees: Fisher-type blocks of ``emb`` would silently miss it. The capture detects such a use
after the forward and raises a ValueError naming the parameter and the fix (a module sharing the
parameter); the fix gives the brute-force blocks. The Hessian needs no records and stays allowed.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from reference import Reference, sample_labels
from torchsso2 import SecondOrderOptimizer, VIOptimizer

V, D, N, T = 5, 3, 4, 3


class FunctionalTiedLM(nn.Module):
    """Embedding → Linear → tanh → mean over positions → ``F.linear(h, emb.weight)`` (no head module)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.lin(self.emb(x))).mean(1), self.emb.weight)


class ModuleTiedLM(FunctionalTiedLM):
    """The same function with the head a bias-free ``nn.Linear`` sharing the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(self.emb(x))).mean(1))


def _batch(cls: type = FunctionalTiedLM):
    torch.manual_seed(0)
    model = cls().double()
    return model, torch.randint(0, V, (N, T)), torch.randint(0, V, (N,))


def _kw(kind: str) -> dict:
    return dict(mc_samples=2, generator=torch.Generator().manual_seed(3)) if kind == "fisher_mc" else {}


@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
@pytest.mark.parametrize("kind", ["fisher", "fisher_mc", "empirical_fisher"])
def test_functional_use_of_a_covered_parameter_is_refused(kind: str, approx: str) -> None:
    model, x, y = _batch()
    with pytest.raises(ValueError) as err:
        curvature.compute(model, x, y, kind=kind, approx=approx, **_kw(kind))
    msg = str(err.value)
    assert "['emb.weight']" in msg and "head.weight = emb.weight" in msg and "skip_modules" in msg
    assert "lin.weight" not in msg  # the Linear's parameters are used inside its own call only


@pytest.mark.parametrize("approx", ["full", "diag"])
@pytest.mark.parametrize("kind", ["fisher", "fisher_mc", "empirical_fisher"])
def test_the_suggested_module_use_gives_the_brute_force_blocks(kind: str, approx: str) -> None:
    """The fix the message names: the same function with a module head sharing the weight has the
    exact blocks of the functional model (brute force over every use, float64)."""
    functional, x, y = _batch()
    tied = ModuleTiedLM().double()
    tied.load_state_dict(functional.state_dict(), strict=False)
    assert torch.equal(tied(x), functional(x))
    ref = Reference(functional, x, y, "cross_entropy")
    labels = sample_labels("cross_entropy", ref.outputs, 2, 3) if kind == "fisher_mc" else None
    c = curvature.compute(tied, x, y, kind=kind, approx=approx, **_kw(kind))
    expected = ref.shaped(kind, approx, labels)
    assert float((c.dense() - expected).abs().max()) <= 1e-8 * max(1.0, float(expected.abs().max()))


def test_hessian_with_a_functional_use_is_exact() -> None:
    """The Hessian is taken through autograd from the loss and sees every use: not refused, exact."""
    model, x, y = _batch()
    c = curvature.compute(model, x, y, kind="hessian", approx="full")
    expected = Reference(model, x, y, "cross_entropy").shaped("hessian", "full", None)
    assert float((c.dense() - expected).abs().max()) <= 1e-8 * max(1.0, float(expected.abs().max()))


def test_functional_use_of_an_uncovered_parameter_is_allowed() -> None:
    """With the embedding left to plain updates its weight is nobody's block: nothing is missed."""
    model, x, y = _batch()
    c = curvature.compute(model, x, y, kind="fisher", approx="diag", skip_modules=["emb"])
    assert list(c.blocks) == ["lin"]


def test_uses_outside_the_model_output_are_not_reported() -> None:
    """A use whose result does not reach the model's output (a penalty on the loss, a discarded
    value) is not the likelihood's and is not refused."""

    class Penalized(ModuleTiedLM):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            _ = self.emb.weight.sum()  # discarded
            return super().forward(x)

    model, x, y = _batch(Penalized)
    opt = SecondOrderOptimizer(model, lr=0.01, approx="diag")

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y) + 1e-3 * model.emb.weight.pow(2).sum()
        loss.backward()
        return loss, out

    opt.step(closure)
    assert opt.num_steps == 1


@pytest.mark.parametrize("make", [
    lambda m: SecondOrderOptimizer(m, lr=0.01),
    lambda m: SecondOrderOptimizer(m, lr=0.01, curvature="empirical_fisher"),
    lambda m: VIOptimizer(m, dataset_size=N, lr=0.01, approx="diag", curvature="fisher_mc", seed=0),
], ids=["sso-kfac-fisher_mc", "sso-kfac-empirical_fisher-from-backward", "vi-diag-fisher_mc"])
def test_optimizers_refuse_a_functional_use_and_leave_the_model_unchanged(make) -> None:
    model, x, y = _batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make(model)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out

    with pytest.raises(ValueError, match=r"\['emb.weight'\] are used in the forward outside"):
        opt.step(closure)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_covered_linear_called_twice_through_its_weight_is_named() -> None:
    """Any covered parameter, not only embeddings: ``F.linear(h, lin.weight)`` next to ``lin(x)``."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.out = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.lin(x))
            return self.out(F.linear(h, self.lin.weight))

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"\['lin.weight'\].*lin.weight: \['lin'\]"):
        curvature.compute(Twice(), torch.randn(4, 3), torch.randint(0, 2, (4,)), kind="fisher", approx="diag")


def _swapped(which: str, w: torch.Tensor) -> torch.Tensor:
    return {"scaled": 2 * w, "clone": w.clone(), "leaf": w.detach().clone().requires_grad_(True)}[which]


@pytest.mark.parametrize("which", ["scaled", "clone", "leaf"])
@pytest.mark.parametrize("make", [
    lambda m: SecondOrderOptimizer(m, curvature="fisher", approx="diag"),
    lambda m: SecondOrderOptimizer(m),  # fisher_mc, K-FAC
    lambda m: SecondOrderOptimizer(m, curvature="empirical_fisher", approx="full"),  # from the user's backward
    lambda m: VIOptimizer(m, dataset_size=N, approx="kfac"),
], ids=["fisher-diag", "fisher_mc-kfac", "empirical-full", "vi-kfac"])
def test_a_weight_swapped_in_by_functional_call_is_refused_on_a_sequential(which, make) -> None:
    """torch.func.functional_call(model, {"0.weight": 2 * W}, x) on a plain nn.Sequential (which the
    dynamic use check does not watch, curvature/uses_static.py): the layer computes with 2W, so its
    recorded inputs and output gradients give the curvature of 2W, not of W (the diagonal was 0.25x
    the brute-force Fisher of W, K-FAC 74-81% off), accepted without a word. Now the ValueError a
    custom module got already, naming the parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(N, D), torch.randint(0, 3, (N,))
    opt = make(model)
    w = model[0].weight

    def closure():
        opt.zero_grad()
        out = torch.func.functional_call(model, {"0.weight": _swapped(which, w)}, (x,))
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"covered module '0' \(Linear\) ran with other tensors in place of its "
                                         r"parameters \['0.weight'\] \(torch.func.functional_call"):
        opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_functional_call_with_the_models_own_parameters_is_the_plain_call() -> None:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x, y = torch.randn(N, D), torch.randint(0, 3, (N,))
    opts = [SecondOrderOptimizer(m, curvature="fisher", approx="kfac") for m in models]
    calls = [lambda m, inp: m(inp), lambda m, inp: torch.func.functional_call(m, dict(m.named_parameters()), (inp,))]
    for _ in range(3):
        for m, opt, call in zip(models, opts, calls):
            def closure(m=m, opt=opt, call=call):
                opt.zero_grad()
                out = call(m, x)
                loss = F.cross_entropy(out, y)
                loss.backward()
                return loss, out
            opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))


@pytest.mark.parametrize("hook", ["none", "logging", "preconditioner"])
def test_a_rollout_closure_feeding_outputs_back_is_no_use_outside(hook: str) -> None:
    """``h = model(h)`` several times in one closure: each forward's check walks its own nodes only (the
    earlier forward's were checked when it ended), so a forward hook on the model (a user's logging hook, a
    KFACPreconditioner's), which turns the runtime check on, does not make the rollout an error."""
    from torchsso2 import KFACPreconditioner
    torch.manual_seed(0)
    x0, ys = torch.randn(16, 4), [torch.randn(16, 4) for _ in range(3)]
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))
    seen = []
    if hook == "logging":
        model[0].register_forward_hook(lambda mod, i, o: seen.append(float(o.detach().abs().mean())))
    pre = KFACPreconditioner(model) if hook == "preconditioner" else None
    opt = SecondOrderOptimizer(model, lr=0.05, loss="mse")

    def closure():
        opt.zero_grad()
        h, loss = x0, 0.0
        for y in ys:
            h = model(h)
            loss = loss + 0.5 * (h - y).pow(2).sum(1).mean()
        (loss / 3).backward()
        return loss / 3
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the rollout's output warning; the same-layers warning)
        for _ in range(2):
            opt.step(closure)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert hook != "logging" or len(seen) >= 6
    del pre


def test_a_functional_use_between_two_forwards_is_still_found() -> None:
    """A covered weight used functionally on the way from one forward's output into the next is a use outside."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[0].register_forward_hook(lambda mod, i, o: None)  # (the runtime check on)
    opt = SecondOrderOptimizer(model, lr=0.05, loss="mse")
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        h = model(x)
        out = model(F.linear(h, model[2].weight))
        loss = 0.5 * (out - y).pow(2).sum(1).mean()
        loss.backward()
        return loss
    with pytest.raises(ValueError, match=r"covered parameter\(s\) \['2.weight'\] are used in the forward outside"):
        opt.step(closure)


@pytest.mark.parametrize("where", ["before_the_first_forward", "carried_to_the_next_forward"])
def test_a_use_only_a_later_forward_reaches_is_found(where: str) -> None:
    """A functional use made before the closure's first forward but consumed by its second (gradient
    accumulation), or state one forward leaves for the next (a memory): no check before the second walked it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[0].register_forward_hook(lambda mod, i, o: None)  # (the runtime check on)
    opt = SecondOrderOptimizer(model, lr=0.05, loss="mse")
    x, x2, y = torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        if where == "before_the_first_forward":
            z = F.linear(x2, model[2].weight)
            loss = 0.5 * ((model(x) - y).pow(2).sum(1).mean() + (model(z) - y).pow(2).sum(1).mean()) / 2
        else:
            memory = F.linear(model(x), model[2].weight)  # what the first forward leaves for the second
            loss = 0.5 * (model(x + memory) - y).pow(2).sum(1).mean()
        loss.backward()
        return loss
    with pytest.raises(ValueError, match=r"covered parameter\(s\) \['2.weight'\] are used in the forward outside"):
        opt.step(closure)
