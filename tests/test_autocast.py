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
from optim_helpers import make_closure

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


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("kind", ["fisher", "fisher_mc", "empirical_fisher"])
def test_attention_under_autocast_is_not_taken_for_a_functional_use(kind: str) -> None:
    """autocast caches the bf16 copy of ``out_proj.weight`` that attention's own forward made, and
    the recorded ``out_proj`` call reuses it: the cast is looked through (its consumer is the use).
    The blocks equal those without the cache; a real functional use is still refused."""
    import curvature
    model = _Attention()
    x, y = torch.randn(4, 5, 8), torch.randint(0, 3, (4,))
    blocks = []
    for cache in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            c = curvature.compute(model, x, y, kind=kind, approx="kfac", generator=torch.Generator().manual_seed(0))
        blocks.append(c.dense())
    torch.testing.assert_close(blocks[0], blocks[1])

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.fc = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return F.linear(self.fc(self.emb(h)), self.emb.weight)

    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="outside the module"):
        curvature.compute(Tied(), torch.randn(4, 3), torch.randint(0, 3, (4,)), kind=kind)


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(x)))


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_one_autocast_context_around_the_loop_trains_as_one_per_step(face: str) -> None:
    """autocast keeps its bf16 weight copies until the outermost context exits: a context around
    the whole loop ran every forward on the first step's weights (or raised for a custom model)."""
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    finals = []
    for one_context in (True, False):
        model = _Custom()
        opt = SecondOrderOptimizer(model, lr=0.1, seed=0) if face == "sso" else \
            VIOptimizer(model, dataset_size=32, lr=0.01, seed=0)
        closure = make_closure(opt, model, x, y)  # cross-entropy runs in float32 under autocast
        if one_context:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                for _ in range(4):
                    opt.step(closure)
        else:
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    opt.step(closure)
        finals.append(_flat(model))
    torch.testing.assert_close(finals[0], finals[1], rtol=0, atol=0)


def test_predict_under_autocast_averages_every_sample() -> None:
    """VIOptimizer.predict inside autocast ran all samples on the first sample's bf16 weights."""
    model = _Custom()
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    opt = VIOptimizer(model, dataset_size=32, lr=0.01, seed=0)
    for _ in range(3):
        opt.step(make_closure(opt, model, x, y))
    full = opt.predict(x, num_samples=8, generator=torch.Generator().manual_seed(0))
    one = opt.predict(x, num_samples=1, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        amp = opt.predict(x, num_samples=8, generator=torch.Generator().manual_seed(0)).float()
    assert (amp - full).abs().max() < 0.01 < (one - full).abs().max()
