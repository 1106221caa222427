"""Every face × shape under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (issue #28 item 6),
with ``step`` called inside the autocast context and outside it (forward inside): no error, no
skipped step, float32 statistics, and a trajectory within bfloat16 error of the float32 one."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner
from torchsso2.optim.precision import autocast_state, full_precision_step

GRID = [(face, approx, where) for face in ("sso", "vi") for approx in ("kfac", "diag", "full")
        for where in ("inside", "outside")] + [("kfac", "kfac", "inside"), ("kfac", "kfac", "outside")]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _train(face: str, approx: str, amp: bool, step_inside: bool, steps: int = 4) -> nn.Module:
    x, y = _data()
    model = _mlp()
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp))
    if face == "kfac":
        pre = KFACPreconditioner(model, damping=1e-2, kl_clip=lambda step: None)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            sgd.zero_grad()
            with ctx():
                loss = F.cross_entropy(model(x), y)
                if step_inside:
                    loss.backward()
                    pre.step()
                    sgd.step()
            if not step_inside:
                loss.backward()
                pre.step()
                sgd.step()
        return model
    if face == "sso":
        opt = SecondOrderOptimizer(model, lr=0.1, curvature="fisher", approx=approx, damping=1e-2, seed=0)
    else:  # damping 100 keeps the posterior narrow: the comparison measures bf16, not sampling chaos
        opt = VIOptimizer(model, dataset_size=1000, lr=0.05, curvature="fisher", approx=approx,
                          prior_precision=1.0, damping=100.0, seed=0)

    def closure():
        opt.zero_grad()
        with ctx():  # a no-op inside an enclosing autocast: the forward runs under it either way
            out = model(x)
            loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out

    for _ in range(steps):
        if step_inside:
            with ctx():
                opt.step(closure)
        else:
            opt.step(closure)
    assert opt.num_skipped == 0
    for blk in opt.running.blocks.values():
        assert all(t.dtype == torch.float32 for t in blk.tensors())
    return model


@pytest.mark.parametrize("face,approx,where", GRID, ids=[f"{f}-{a}-step-{w}" for f, a, w in GRID])
def test_bfloat16_autocast_every_face_and_shape(face, approx, where):
    ref = _flat(_train(face, approx, amp=False, step_inside=where == "inside"))
    got = _flat(_train(face, approx, amp=True, step_inside=where == "inside"))
    moved = (ref - _flat(_mlp())).norm()
    assert moved > 1e-3
    assert torch.isfinite(got).all()
    # bf16 forward/backward (8-bit mantissa) keeps the trajectory within a few percent of float32
    assert (got - ref).norm() < 0.1 * moved


def test_step_body_runs_without_autocast_and_closure_with_it():
    seen = {}

    class Probe:
        @full_precision_step
        def step(self, closure=None):
            seen["body"] = autocast_state()
            seen["closure"] = closure()

    def closure():
        return autocast_state()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        Probe().step(closure)
        assert autocast_state() == (("cpu", torch.bfloat16),)  # restored after the step
    assert seen == {"body": (), "closure": (("cpu", torch.bfloat16),)}
    Probe().step(closure)  # outside autocast nothing changes
    assert seen == {"body": (), "closure": ()}
