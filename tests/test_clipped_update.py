"""torchsso2/optim/clipped_update.py: the KL clip and the finite check of a preconditioned update in
one pass equal the three passes they replace (kl_clip_factor, a scaled copy, owned_all_finite)."""
from __future__ import annotations

import math
from typing import List, Optional

import pytest
import torch
from torch import nn

from curvature.blocks.base import owned_all_finite
from torchsso2 import SecondOrderOptimizer
from torchsso2.optim.clipped_update import clip_and_check, clip_scale
from torchsso2.optim.steps import kl_clip_factor
from optim_helpers import make_closure


def _three_passes(updates, vecs, lrs, kl_clip) -> Optional[List[torch.Tensor]]:
    """What SecondOrderOptimizer's step did before: ν, a scaled copy, then the finite check."""
    nu = kl_clip_factor(updates, vecs, lrs, kl_clip)
    out = [u * nu for u in updates]
    return out if owned_all_finite(out) else None


def _tensors(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (7,), (3, 7), (3,)]
    updates = [scale * torch.randn(s, generator=g) for s in shapes]
    vecs = [u + 0.1 * torch.randn(u.shape, generator=g) for u in updates]  # uᵀd > 0
    return updates, vecs


@pytest.mark.parametrize("kl_clip", [1e-6, 1e-3, 1e3])  # binding hard, binding, not binding
@pytest.mark.parametrize("lrs", [[0.1] * 4, [0.1, 0.1, 0.03, 0.0]])
def test_equals_the_three_passes(kl_clip, lrs):
    updates, vecs = _tensors(0)
    before = [u.clone() for u in updates]
    got, want = clip_and_check(updates, vecs, lrs, kl_clip), _three_passes(updates, vecs, lrs, kl_clip)
    assert got is not None and want is not None
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0)
    for u, b in zip(updates, before):  # the inputs (an update may be p.grad) are not written
        assert torch.equal(u, b)


def test_an_unbinding_clip_returns_the_updates_themselves():
    updates, vecs = _tensors(1)
    got = clip_and_check(updates, vecs, [0.1] * 4, 1e6)
    assert all(a is b for a, b in zip(got, updates))


def test_a_negative_inner_product_is_not_clipped():
    updates, vecs = _tensors(2)
    vecs = [-v for v in vecs]
    assert all(a is b for a, b in zip(clip_and_check(updates, vecs, [0.1] * 4, 1e-9), updates))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("zero_grad_there", [False, True])
@pytest.mark.parametrize("lr", [0.1, 0.0])
def test_a_non_finite_update_is_found(bad, zero_grad_there, lr):
    updates, vecs = _tensors(3)
    updates[2][1, 4] = bad
    if zero_grad_there:  # inf · 0 = NaN: still found
        vecs[2][1, 4] = 0.0
    assert clip_and_check(updates, vecs, [lr] * 4, 1e-3) is None
    assert _three_passes(updates, vecs, [lr] * 4, 1e-3) is None


def test_finite_updates_whose_inner_product_overflows_take_the_float64_clip():
    """A finite update with an overflowing float32 ``vg`` (inf) is checked element by element: finite,
    so ``vg`` is summed again in float64 and the update scaled by that ``ν`` (both paths)."""
    updates, vecs = _tensors(4, scale=1e20)
    got, want = clip_and_check(updates, vecs, [1.0] * 4, 1e-3), _three_passes(updates, vecs, [1.0] * 4, 1e-3)
    assert got is not None and want is not None
    vg = sum(float((u.double() * d.double()).sum()) for u, d in zip(updates, vecs))
    nu = math.sqrt(1e-3 / vg)
    for a, b, u in zip(got, want, updates):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, u * nu)
        assert torch.isfinite(a).all() and a.abs().sum() > 0


def test_mixed_dtypes_and_non_contiguous_tensors():
    updates, vecs = _tensors(5)
    updates[0] = updates[0].t().contiguous().t()  # same values, column-major
    updates[1], vecs[1] = updates[1].double(), vecs[1].double()
    got, want = clip_and_check(updates, vecs, [0.1] * 4, 1e-3), _three_passes(updates, vecs, [0.1] * 4, 1e-3)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0)


class _ThreePassOptimizer(SecondOrderOptimizer):
    """SecondOrderOptimizer whose step clips and checks as before (three passes)."""

    @torch.no_grad()
    def _apply_update(self, params, groups):
        from torchsso2.optim.steps import momentum_step_

        plan = self._plans.get(params, groups, self.running.blocks)
        vecs = [p.grad for p in params]
        updates = plan.precondition(vecs, solved=self._low_rank_solve(plan, vecs, plan.values("weight_decay")))
        updates = _three_passes(updates, vecs, plan.values("lr"), self.kl_clip)
        if updates is None:
            return False
        momentum_step_(params, updates, [self.state[p] for p in params], plan.values("lr"),
                       plan.values("momentum"), self._scalars)
        return True


def test_kfac_training_equals_the_three_pass_step():
    """A small K-FAC run at 2/6 intervals (the last layer left to plain SGD: its update is its
    gradient itself) follows the three-pass step to float tolerance."""
    runs = []
    for cls in (SecondOrderOptimizer, _ThreePassOptimizer):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
        x, y = torch.randn(40, 10), torch.randint(0, 4, (40,))
        opt = cls(model, lr=0.3, damping=0.03, curv_update_interval=2, inv_update_interval=6, kl_clip=3e-3,
                  skip_modules=["2"], seed=0)
        for i in range(30):
            xb, yb = x[(i * 8) % 40:(i * 8) % 40 + 8], y[(i * 8) % 40:(i * 8) % 40 + 8]

            closure = make_closure(opt, model, xb, yb)

            opt.step(closure)
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)


def test_products_overflowing_float32_are_summed_again_in_float64() -> None:
    """Finite float32 updates whose ``lr²·uᵀd`` overflows float32 (found by an audit: ν became 0 and
    the fused step divided by it, or NaN turned the clip off): ν is taken from the float64 sum."""
    u, d = torch.full((10,), 1e20), torch.full((10,), 1e20)
    nu = clip_scale([u], [d], [0.05], 1e-3)
    assert nu == pytest.approx(math.sqrt(1e-3 / (0.05 ** 2 * 10 * 1e40)), rel=1e-6)
    assert clip_scale([torch.tensor([1e30, 1e30])], [torch.tensor([1e30, -1e30])], [0.05], 1e-3) == 1.0  # uᵀd = 0
    huge = torch.tensor([1e200], dtype=torch.float64)
    assert clip_scale([huge], [huge], [1.0], 1e-3) is None  # beyond float64: not a usable step


@pytest.mark.parametrize("approx, interval", [("diag", 2), ("kfac", 2), ("full", 1)])
def test_a_huge_but_finite_batch_takes_a_bounded_step(approx: str, interval: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    opt = SecondOrderOptimizer(model, lr=0.05, approx=approx, curv_update_interval=interval,
                               inv_update_interval=interval, seed=3)

    for _ in range(3):
        opt.step(make_closure(opt, model, x, y))
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(make_closure(opt, model, x * 1e20, y))
    moved = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)])
    assert torch.isfinite(moved).all()
    # the step bounded by the clip (momentum 0.9 adds at most 10x the previous steps' size)
    assert float(moved.abs().max()) < 1.0
