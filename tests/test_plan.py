"""The cached per-step bookkeeping of the optimizers' updates (torchsso2/optim/plan.py) and the
other step-overhead fast paths: the plan follows every change of parameters, groups and blocks;
cached 0-dim hyperparameters give the same numbers as Python floats; the concatenated finiteness
check agrees with the element-wise definition."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import curvature
from curvature.blocks.base import all_finite
from torchsso2 import SecondOrderOptimizer
from torchsso2.optim.plan import PartialBlock, PlanCache, ScalarCache, build_plan, params_with_grad
from torchsso2.optim.steps import momentum_step_


def _model_and_blocks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    blocks = curvature.compute(model, x, y, kind="fisher", approx="kfac").blocks
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model, blocks


def test_plan_maps_blocks_to_positions_and_groups() -> None:
    model, blocks = _model_and_blocks()
    groups = [dict(params=list(model[0].parameters()), lr=0.1), dict(params=list(model[2].parameters()), lr=0.2)]
    params, owners = params_with_grad(groups)
    plan = build_plan(params, owners, blocks)
    assert [pos for _, pos in plan.blocks] == [[0, 1], [2, 3]]
    assert plan.values("lr") == [0.1, 0.1, 0.2, 0.2] and plan.in_block == [True] * 4
    # a parameter without a gradient drops out; its block stays for the others, as a PartialBlock
    # solving [v | 0] (the absent parameter's entries zero) with the whole block
    model[2].bias.grad = None
    params, owners = params_with_grad(groups)
    plan = build_plan(params, owners, blocks)
    assert len(params) == 3 and [pos for _, pos in plan.blocks] == [[0, 1], [2]]
    assert plan.in_block == [True, True, True]
    partial = plan.blocks[1][0]
    assert isinstance(partial, PartialBlock) and partial.block is blocks["2"]
    blocks["2"].decompose(0.1)
    v = torch.randn_like(model[2].weight)
    expected = blocks["2"].solve([v, torch.zeros_like(model[2].bias)])[0]
    assert torch.equal(partial.solve([v])[0], expected)


def test_plan_cache_follows_parameters_groups_and_blocks() -> None:
    model, blocks = _model_and_blocks()
    cache = PlanCache()
    group = dict(params=list(model.parameters()), lr=0.1)
    params, owners = params_with_grad([group])
    first = cache.get(params, owners, blocks)
    assert cache.get(params, owners, blocks) is first  # nothing changed: the same plan
    # a new group object for the same parameters (add_param_group / a rebuilt optimizer)
    other = dict(group)
    assert cache.get(params, [other] * len(params), blocks) is not first
    # new blocks (a checkpoint load replaces them)
    again = cache.get(params, owners, blocks)
    fresh = dict(blocks)
    fresh["0"] = type(blocks["0"])(blocks["0"].layout, blocks["0"].left.clone(), blocks["0"].right.clone())
    swapped = cache.get(params, owners, fresh)
    assert swapped is not again and swapped.blocks[0][0] is fresh["0"]
    # a Parameter swapped inside a covered module: the block's parameters change identity, and
    # the old position no longer belongs to it (the block keeps only the parameter still given)
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    swapped_param = cache.get(params, owners, fresh)
    assert swapped_param is not swapped and swapped_param.blocks[1][0] is fresh["2"]
    assert isinstance(swapped_param.blocks[0][0], PartialBlock) and swapped_param.blocks[0][1] == [1]
    assert swapped_param.in_block[0] is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scalar_cache_momentum_is_bit_identical(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    shapes = [(3, 4), (4,), (2,)]
    a = [torch.randn(s).to(dtype) for s in shapes]
    b = [t.clone() for t in a]
    sa, sb = [dict() for _ in shapes], [dict() for _ in shapes]
    cache = ScalarCache()
    for _ in range(3):
        grads = [torch.randn(s).to(dtype) for s in shapes]
        momentum_step_(a, grads, sa, [0.1] * 3, [0.9, 0.9, 0.5])
        momentum_step_(b, grads, sb, [0.1] * 3, [0.9, 0.9, 0.5], cache)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    if dtype == torch.bfloat16:  # half precision keeps the Python float (the 0-dim factor rounds differently)
        assert cache.get(0.9, a[0]) == 0.9
    else:
        t = cache.get(0.9, a[0])
        assert isinstance(t, torch.Tensor) and t.dtype == dtype and cache.get(0.9, a[0]) is t


def test_all_finite_concatenated_path_mixed_dtypes() -> None:
    ok = [torch.ones(3, dtype=torch.float16), torch.ones(2, 2), torch.ones(4, dtype=torch.float64),
          torch.tensor(1.0, requires_grad=True)]
    assert all_finite(ok)
    for i in range(3):
        for bad in (math.nan, math.inf):
            ts = [t.detach().clone() for t in ok]
            ts[i].view(-1)[1] = bad
            assert not all_finite(ts)
    # finite values whose concatenated sum overflows float16/float32: still finite
    big = [torch.full((3,), 6e4, dtype=torch.float16), torch.full((2,), 3e38), torch.ones(3)]
    assert all_finite(big)
    # more elements than the concatenated path takes: one sum per tensor, same answer
    large = [torch.ones(1 << 15), torch.ones(1 << 15), torch.ones(5)]
    assert all_finite(large)
    large[2][0] = math.nan
    assert not all_finite(large)


def test_optimizer_update_follows_a_new_param_group() -> None:
    """add_param_group after some steps: the cached plan is rebuilt (the new group's lr is used)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    extra = nn.Parameter(torch.zeros(2))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    opt = SecondOrderOptimizer(model, lr=0.1, curvature="fisher", approx="kfac", damping=0.1, kl_clip=None)

    def closure():
        opt.zero_grad()
        out = model(x) + extra
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        return loss, out

    opt.step(closure)
    opt.add_param_group(dict(params=[extra], lr=0.5, momentum=0.0))
    opt.step(closure)
    before = extra.detach().clone()
    opt.step(closure)
    # extra is uncovered by any block: plain SGD with its own group's lr and no momentum
    assert extra.grad is not None and float(extra.grad.abs().sum()) > 0
    torch.testing.assert_close(extra.detach(), before - 0.5 * extra.grad, rtol=0, atol=1e-7)


def _mixed_blocks():
    """A 3-layer model with a diagonal, a K-FAC and an uncovered layer (decomposed blocks), and
    per-parameter vectors."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    model.double()
    blocks = curvature.compute(model, x, y, kind="fisher", approx={"0": "diag", "2": "kfac"},
                               skip_modules=["4"]).blocks
    for blk in blocks.values():
        blk.decompose(0.1, scale=3.0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model, blocks


@pytest.mark.parametrize("two_lrs", [False, True])
def test_preconditioned_descent_equals_solve_then_add(two_lrs: bool) -> None:
    """θ ← θ − lr·block_scale·C⁻¹v (blocks; the diagonal one fused into one addcmul) and
    θ ← θ − lr·other_scale·v (uncovered), against the plain solves of each block."""
    from torchsso2.optim.steps import preconditioned_descent_

    model, blocks = _mixed_blocks()
    params = list(model.parameters())
    groups = [dict(lr=0.1)] * 4 + [dict(lr=0.3 if two_lrs else 0.1)] * 2
    plan = build_plan(params, groups, blocks)
    vecs = [torch.randn_like(p) for p in params]
    expected = [p.detach().clone() for p in params]
    for blk, pos in plan.blocks:
        for i, s in zip(pos, blk.solve([vecs[i] for i in pos])):
            expected[i] -= groups[i]["lr"] * 7.0 * s
    for i in plan.others:
        expected[i] -= groups[i]["lr"] * 0.5 * vecs[i]
    assert plan.others == [4, 5]
    with torch.no_grad():
        preconditioned_descent_(plan, params, vecs, plan.values("lr"), 7.0, 0.5)
    for p, e in zip(params, expected):
        assert torch.allclose(p, e, rtol=1e-13, atol=1e-15)


def test_natural_momentum_is_the_formula_and_leaves_gradients() -> None:
    """m ← momentum·m + (g + prior·μ) through SGD's fused kernel for existing buffers; the first
    use and momentum 0 out of place; gradients and means are not changed."""
    from torchsso2.optim.steps import natural_momentum_

    torch.manual_seed(2)
    shapes = [(3, 4), (4,), (2,)]
    means = [torch.randn(s, dtype=torch.float64) for s in shapes]
    states = [dict() for _ in shapes]
    moms = [0.9, 0.5, 0.0]
    ref = [None] * 3
    for _ in range(3):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        g0, m0 = [g.clone() for g in grads], [m.clone() for m in means]
        out = natural_momentum_(states, grads, means, 0.25, moms)
        for i in range(3):
            raw = grads[i] + 0.25 * means[i]
            ref[i] = raw if moms[i] == 0.0 or ref[i] is None else moms[i] * ref[i] + raw
            assert torch.allclose(out[i], ref[i], rtol=1e-14, atol=1e-15)
        assert all(torch.equal(a, b) for a, b in zip(grads, g0)) and all(torch.equal(a, b) for a, b in zip(means, m0))
        assert "momentum_buffer" not in states[2] and out[0] is states[0]["momentum_buffer"]


@pytest.mark.parametrize("approx", ["kfac", "full", "diag"])
def test_a_block_frozen_in_part_after_construction_warns_where_the_step_differs(approx: str) -> None:
    """A bias frozen after the optimizer was built: the weight gets ((C + λI)⁻¹)_WW g_W, not the
    (C_WW + λI)⁻¹ g_W of an optimizer built after the freezing (the natural gradient with the bias fixed).
    A K-FAC or full block warns once, naming the block; a diagonal block gives the same step and does not."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))

    def step(freeze_before: bool) -> tuple:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
        if freeze_before:
            model[0].bias.requires_grad_(False)
        opt = SecondOrderOptimizer(model, approx=approx, curvature="fisher", lr=0.1, damping=1e-3, kl_clip=None)
        model[0].bias.requires_grad_(False)
        before = model[0].weight.detach().clone()

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step(closure)
            opt.step(closure)
        return model[0].weight.detach() - before, [str(w.message) for w in caught if "frozen" in str(w.message)]

    mid, mid_warnings = step(False)
    built, built_warnings = step(True)
    assert built_warnings == []
    if approx == "diag":
        torch.testing.assert_close(mid, built, rtol=1e-12, atol=0)
        assert mid_warnings == []
    else:
        assert (mid - built).norm() > 0.01 * built.norm()  # 1.9% (K-FAC), 50% (full) here; round-off is 1e-15
        assert len(mid_warnings) == 1 and "blocks ['0']" in mid_warnings[0]



def test_a_frozen_parameter_with_a_zero_gradient_does_not_move() -> None:
    """``zero_grad(set_to_none=False)`` leaves a zero gradient on a parameter frozen after construction; solved
    with its block, that zero still moved it (0.9 in two steps, through the block's coupling)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    opt = SecondOrderOptimizer(model, approx="full", curvature="fisher", lr=0.1, damping=1e-3, kl_clip=None)

    def closure() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    model[0].bias.requires_grad_(False)
    bias, weight = model[0].bias.detach().clone(), model[0].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the partly frozen block's warning)
        opt.step(closure)
        opt.step(closure)
    assert model[0].bias.grad is not None and torch.equal(model[0].bias.detach(), bias)
    assert not torch.equal(model[0].weight.detach(), weight)


def test_a_damping_set_in_one_process_overrides_a_request_from_a_checkpoint() -> None:
    """A checkpoint saved by several processes between ``opt.damping = x`` and the next step holds the request;
    loaded in one process it is taken at the next step, unless the user sets the damping first (it had stayed
    0.5 over the user's 0.01)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    opt = SecondOrderOptimizer(model, approx="kfac", lr=0.1, damping=0.1, seed=0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    saved = opt.state_dict()
    saved["torchsso2"]["extra"]["damping_request"] = 0.5
    opt.load_state_dict(saved)
    assert opt.damping == 0.5
    opt.step(closure)
    assert opt.damping == 0.5 and opt._damping == 0.5  # taken at the step
    opt.load_state_dict(saved)
    opt.damping = 0.01
    assert opt.damping == 0.01
    opt.step(closure)
    assert opt.damping == 0.01 and opt._damping == 0.01
    saved["torchsso2"]["extra"]["damping_request"] = float("nan")
    with pytest.raises(ValueError, match="damping_request"):
        opt.load_state_dict(saved)


def test_only_a_rank_that_disagreed_blames_another_rank() -> None:
    """The non-finite message names another rank's batch only where the ranks did not agree the batch was finite
    (a non-finite update of finite values, the same on every rank, is not another rank's)."""
    model = nn.Linear(3, 2)
    opt = SecondOrderOptimizer(model, lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    loss = torch.tensor(1.0)
    assert opt._what_is_nonfinite(loss, None)() == ""
    assert opt._what_is_nonfinite(loss, None, other_rank=True)().startswith("another rank's loss or batch")
    assert opt._what_is_nonfinite(torch.tensor(float("nan")), None, other_rank=True)() == "the loss (nan)"
