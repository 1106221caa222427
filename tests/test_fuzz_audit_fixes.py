"""Findings of a randomized differential audit (random models against torch.func brute force):
a failed decomposition of one block leaves every block on its previous decomposition."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import curvature
import torchsso2
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

        def closure():
            opt.zero_grad()
            out = model(x)
            val = 0.5 * (out - y).pow(2).sum(1).mean()
            val.backward()
            return val, out
        with caplog.at_level(logging.WARNING):
            opt.step(closure, targets=y)
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
