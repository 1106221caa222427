"""Findings of randomized differential audits (random models against torch.func brute force, adaptive
mode against its 2x2 model, KFACPreconditioner against kfac_pytorch): a failed decomposition of one
block leaves every block on its previous decomposition; parallel adaptive directions; lazy modules;
a bad factor_decay in the backward hook."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import curvature
import torchsso2
from optim_helpers import make_closure
from curvature.blocks import FullBlock
from curvature.linalg import LinalgError
from curvature.running import RunningCurvature
from curvature.selection import select_layouts


class _HeadFirst(nn.Module):
    """The head registered before the body: its (healthy, PSD) Hessian block comes first."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)
        self.body = nn.Linear(3, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def test_running_decompose_is_all_or_nothing() -> None:
    """RunningCurvature.decompose: when a later block fails, an earlier one that succeeded is given back
    its previous decomposition (it kept the new one, so a step mixed the two curvatures)."""
    model = _HeadFirst().double()
    layouts, _ = select_layouts(model, "full")
    running = RunningCurvature()
    eye = {n: torch.eye(lay.numel, dtype=torch.float64) for n, lay in layouts.items()}
    running.update({n: FullBlock(lay, eye[n]) for n, lay in layouts.items()}, 0.0)
    running.decompose(0.1)
    before = {n: b.decomposition for n, b in running.blocks.items()}
    running.blocks["head"].matrix.mul_(2.0)                 # healthy: would decompose
    running.blocks["body"].matrix.fill_(0.0).diagonal().fill_(-5.0)  # -5 + 0.1 < 0: fails
    with pytest.raises(LinalgError, match="'body'"):
        running.decompose(0.1)
    assert all(running.blocks[n].decomposition is before[n] for n in before)


def test_failed_hessian_decomposition_keeps_every_block_previous(caplog) -> None:
    """A Hessian step whose second block is indefinite beyond the damping: the step uses the previous
    decomposition of every block (the first, healthy block used the new one, the second the old one),
    and the warning says so."""
    torch.manual_seed(0)
    model = _HeadFirst().double()
    x = torch.randn(8, 3, dtype=torch.float64)
    with torch.no_grad():
        y0 = model(x) + 0.1 * torch.randn(8, 2, dtype=torch.float64)
    y1 = y0 + 30.0 * torch.randn_like(y0)
    lam, lr = 1.0, 0.1
    opt = torchsso2.SecondOrderOptimizer(model, lr=lr, momentum=0.0, curvature="hessian", approx="full",
                                         damping=lam, kl_clip=None, ema_decay=0.0, loss="mse")
    hessians = []
    for y in (y0, y1):
        c = curvature.compute(copy.deepcopy(model), x, y, loss="mse", kind="hessian", approx="full")
        hessians.append({n: b.dense() for n, b in c.blocks.items()})
        probe = copy.deepcopy(model)
        loss = 0.5 * (probe(x) - y).pow(2).sum(1).mean()
        grads = dict(zip([n for n, _ in probe.named_parameters()], torch.autograd.grad(loss, list(probe.parameters()))))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with caplog.at_level(logging.WARNING):
            opt.step(make_closure(opt, model, x, y, loss="mse"), targets=y)
    assert float(torch.linalg.eigvalsh(hessians[1]["body"]).min()) + lam < 0      # the second step's body fails
    assert float(torch.linalg.eigvalsh(hessians[1]["head"]).min()) + lam > 0      # its head would not
    assert opt.num_skipped == 1
    for name in ("head", "body"):
        g = torch.cat([grads[f"{name}.weight"].reshape(-1), grads[f"{name}.bias"].reshape(-1)])
        moved = torch.cat([(model.get_parameter(f"{name}.{q}").detach() - before[f"{name}.{q}"]).reshape(-1)
                           for q in ("weight", "bias")])
        want = -lr * torch.linalg.solve(hessians[0][name] + lam * torch.eye(len(g), dtype=torch.float64), g)
        torch.testing.assert_close(moved, want, rtol=1e-9, atol=1e-12)
    assert "every block keeps its previous decomposition" in caplog.text


def test_adaptive_solve_with_parallel_directions_takes_the_first_alone() -> None:
    """A singular 2x2 model of a PSD curvature (Δ ∥ δ_prev) is solved along Δ alone (μ = 0), the same
    minimum; it was refused as 'not positive definite'. An indefinite one is still refused."""
    from torchsso2.optim.adaptive import solve_quadratic
    u = torch.tensor([2.0, -1.0], dtype=torch.float64)  # δ_prev = -0.5·Δ in a 1-D model with curvature 3
    a, b = 3.0 * torch.outer(u, u), -1.5 * u
    (alpha, mu), value = solve_quadratic(a, b, [None, None])
    assert mu == 0.0 and alpha == pytest.approx(0.25, rel=1e-12) and value == pytest.approx(-0.375, rel=1e-12)
    with pytest.raises(ValueError, match="not positive definite"):
        solve_quadratic(torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64), b, [None, None])


def test_adaptive_mode_keeps_training_when_every_update_is_parallel() -> None:
    """Least squares on whitened inputs (XᵀX/N = I): every preconditioned gradient is parallel to the last
    update, so the 2x2 model is singular from the second step on. Every step is taken and the weights
    reach the solution (before: every step from the fifth was skipped, then NonFiniteError at the 24th)."""
    torch.manual_seed(0)
    n, d = 64, 3
    q, _ = torch.linalg.qr(torch.randn(n, d, dtype=torch.float64))
    x = q * n ** 0.5
    target = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    y = x @ target.t()
    model = nn.Linear(d, 1, bias=False).double()
    opt = torchsso2.SecondOrderOptimizer(model, approx="full", curvature="fisher", loss="mse", damping=0.1,
                                         use_adaptive_learning_rate=True, use_adaptive_momentum=True)
    for _ in range(25):
        opt.step(make_closure(opt, model, x, y, loss="mse"), targets=y)
    assert opt.num_skipped == 0
    torch.testing.assert_close(model.weight.detach(), target, rtol=0, atol=1e-10)


def test_lazy_modules_not_yet_run_are_refused_with_the_fix() -> None:
    """An nn.LazyLinear that has not run: a ValueError naming it and the fix on every face (torch's
    'Can't access the shape of an uninitialized parameter ... load_state_dict' before)."""
    from torchsso2.kfac import KFACPreconditioner
    model = nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.Linear(3, 2))
    faces = [lambda: torchsso2.SecondOrderOptimizer(model), lambda: torchsso2.VIOptimizer(model, 10),
             lambda: KFACPreconditioner(model),
             lambda: curvature.compute(model, torch.randn(2, 4), torch.tensor([0, 1]))]
    for face in faces:
        with pytest.raises(ValueError, match=r"\['0'\] have uninitialized \(lazy\) parameters.*one forward pass"):
            face()
    model(torch.randn(1, 4))
    torchsso2.SecondOrderOptimizer(model)


def test_bad_factor_decay_in_the_hook_leaves_every_layer_untouched() -> None:
    """KFACPreconditioner(update_factors_in_hook=True) with a factor_decay callable returning a bad value:
    the error comes out of backward() before the batch reaches any layer (the last layer had taken it in,
    so a later fold averaged the aborted batch in: A 0.09 off)."""
    from torchsso2.kfac import KFACPreconditioner
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1,
                             factor_decay=lambda step: 2.0 if step == 1 else 0.5)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    pre.step()
    model.zero_grad()
    layers = [layer for _, layer in pre._layers.values()]
    before = [(layer.a_factor.clone(), layer.g_factor.clone()) for layer in layers]
    with pytest.raises(ValueError, match="factor_decay"):
        nn.functional.cross_entropy(model(torch.randn(8, 4, dtype=torch.float64)), y).backward()
    assert all(layer.a_count == layer.g_count == 0 for layer in layers)  # no layer took the batch in
    for layer, (a, g) in zip(layers, before):
        assert torch.equal(layer.a_factor, a) and torch.equal(layer.g_factor, g)


def test_lazy_modules_the_user_skips_take_the_plain_update() -> None:
    """A lazy module left out (skip_modules / skip_layers) is not refused: it takes the plain update, as
    before and as in kfac_pytorch."""
    from torchsso2.kfac import KFACPreconditioner
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.LazyLinear(3))
    opt = torchsso2.SecondOrderOptimizer(model, approx="kfac", skip_modules=[r"^2$"])
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    opt.step(make_closure(opt, model, x, y))
    assert list(opt.engine.layouts) == ["0"] and torch.isfinite(model[2].weight).all()
    assert len(KFACPreconditioner(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.LazyLinear(3)),
                                  skip_layers=["2"])._layers) == 1
