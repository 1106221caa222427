"""Reliability of the native optimizers (issue #9): adversarial numerics, decomposition
failures, mixed precision, GradScaler, gradient accumulation, frozen/skipped parameters."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchsso2 import NonFiniteError, SecondOrderOptimizer, VIOptimizer

SHAPES = ["kfac", "diag", "full"]


def _mlp(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def _data(n=32, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _make(kind, model, **kw):
    if kind == "sso":
        return SecondOrderOptimizer(model, lr=0.1, curvature="fisher", damping=1e-2, seed=0, **kw)
    return VIOptimizer(model, dataset_size=1000, lr=0.05, curvature="fisher", prior_precision=1.0, seed=0, **kw)


def _closure(opt, model, x, y, micro=1, scaler=None):
    def closure():
        opt.zero_grad()
        total = 0.0
        out = None
        for xb, yb in zip(x.chunk(micro), y.chunk(micro)):
            out = model(xb)
            loss = F.cross_entropy(out, yb) / micro
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total = total + loss.detach()
        return total, out
    return closure


# ---- gradient accumulation: K micro-batches of B == one batch of K·B -----------------------------
@pytest.mark.parametrize("face", ["sso", "vi"])
@pytest.mark.parametrize("approx", SHAPES)
def test_accumulation_equals_one_big_batch(face, approx):
    x, y = _data(32)
    results = []
    for micro in (1, 4):
        model = _mlp()
        opt = _make(face, model, approx=approx, **({"num_mc_samples": 1} if face == "vi" else {}))
        for _ in range(3):
            opt.step(_closure(opt, model, x, y, micro=micro))
        results.append(_flat(model))
    assert torch.allclose(results[0], results[1], atol=1e-10, rtol=1e-9)
    # and the update was not trivial
    assert (results[0] - _flat(_mlp())).abs().max() > 1e-4


# ---- frozen parameters and skipped modules are not touched --------------------------------------
@pytest.mark.parametrize("approx", SHAPES)
def test_frozen_and_skipped_parameters_untouched(approx):
    x, y = _data(16)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = SecondOrderOptimizer(model, kl_clip=None, lr=0.1, momentum=0.0, curvature="fisher", approx=approx, damping=1e-2,
                               skip_modules=[r"^2$"])
    assert "2" not in opt.engine.layouts and "4" in opt.engine.layouts
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step(_closure(opt, model, x, y))
    assert torch.equal(model[0].weight, frozen)
    # skipped module: plain SGD update with the same lr
    for n in ("2.weight", "2.bias"):
        p = dict(model.named_parameters())[n]
        # the closure's gradient at the old parameters, recomputed independently
        m2 = copy.deepcopy(model)
        with torch.no_grad():
            for (nn_, q) in m2.named_parameters():
                q.copy_(before[nn_])
        F.cross_entropy(m2(x), y).backward()
        expect = before[n] - 0.1 * dict(m2.named_parameters())[n].grad
        assert torch.allclose(p.detach(), expect, atol=1e-12)


# ---- adversarial inputs ----------------------------------------------------------------------------
@pytest.mark.parametrize("approx", SHAPES)
@pytest.mark.parametrize("case", ["zeros", "huge", "rank_deficient"])
def test_adversarial_inputs_keep_state_finite(approx, case):
    x, y = _data(16, dtype=torch.float32)
    if case == "zeros":
        x = torch.zeros_like(x)
    elif case == "huge":
        x = x * 1e6
    else:
        x = x[:1].repeat(16, 1)  # every example identical: rank-one statistics
    model = _mlp(torch.float32)
    opt = SecondOrderOptimizer(model, lr=1e-3, curvature="fisher", approx=approx, damping=1e-3, seed=0)
    for _ in range(3):
        opt.step(_closure(opt, model, x, y))
    assert torch.isfinite(_flat(model)).all()
    for blk in opt.running.blocks.values():
        assert blk.is_finite()


def test_decomposition_failure_skip_keeps_previous_and_raise_policy():
    # the Hessian of a tanh network is indefinite: with damping 0 its decomposition is not PD
    x, y = _data(16)
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.1, curvature="hessian", approx="full", damping=0.0)
    before = _flat(model)
    opt.step(_closure(opt, model, x, y), targets=y)
    assert opt.num_skipped == 1
    assert torch.equal(_flat(model), before)  # no decomposition yet: nothing was applied

    model2 = _mlp()
    opt2 = SecondOrderOptimizer(model2, lr=0.1, curvature="hessian", approx="full", damping=0.0,
                                on_nonfinite="raise")
    with pytest.raises(NonFiniteError, match="decomposition failed"):
        opt2.step(_closure(opt2, model2, x, y), targets=y)


def test_hessian_with_enough_damping_and_float64_decomposition():
    x, y = _data(16, dtype=torch.float32)
    model = _mlp(torch.float32)
    opt = SecondOrderOptimizer(model, lr=0.1, curvature="hessian", approx="full", damping=10.0,
                               decomposition_dtype=torch.float64)
    opt.step(_closure(opt, model, x, y), targets=y)
    assert opt.num_skipped == 0
    dec = next(iter(opt.running.blocks.values())).decomposition
    assert dec["evecs"].dtype == torch.float64


def test_nonfinite_output_is_skipped_not_crashing():
    x, y = _data(16, dtype=torch.float32)
    model = _mlp(torch.float32)
    opt = SecondOrderOptimizer(model, lr=0.1, curvature="fisher_mc", approx="kfac", damping=1e-2)
    opt.step(_closure(opt, model, x, y))
    state = copy.deepcopy(opt.state_dict())
    params = _flat(model)
    bad = x.clone()
    bad[0, 0] = float("nan")
    opt.step(_closure(opt, model, bad, y))
    assert opt.num_skipped == 1
    assert torch.equal(_flat(model), params)
    for a, b in zip(opt.running.tensors(), [t for bs in state["torchsso2"]["curvature"]["blocks"].values()
                                            for t in bs["tensors"]]):
        assert torch.equal(a, b)


# ---- mixed precision -----------------------------------------------------------------------------
@pytest.mark.parametrize("face", ["sso", "vi"])
@pytest.mark.parametrize("approx", SHAPES)
def test_autocast_bfloat16_keeps_statistics_in_float32(face, approx):
    x, y = _data(32, dtype=torch.float32)
    model = _mlp(torch.float32)
    # VI: damping 100 keeps the posterior (and so the trajectory) well-conditioned; without it the
    # weakly-curved directions have unit variance and the comparison below measures chaos, not bf16
    extra = {"damping": 100.0} if face == "vi" else {}
    opt = _make(face, model, approx=approx, **extra)

    def closure():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out

    ref_model = _mlp(torch.float32)
    ref = _make(face, ref_model, approx=approx, **extra)
    for _ in range(5):
        opt.step(closure)
        ref.step(_closure(ref, ref_model, x, y))
    # bf16 forward/backward (8-bit mantissa, rel. error ~4e-3 per op) keeps the trajectory
    # within a few percent of the float32 one; a wrong cast or a dropped step would not be
    moved = (_flat(ref_model) - _flat(_mlp(torch.float32))).norm()
    assert moved > 1e-3
    assert (_flat(model) - _flat(ref_model)).norm() < 0.1 * moved
    for blk in opt.running.blocks.values():
        assert all(t.dtype == torch.float32 for t in blk.tensors())
    assert opt.num_skipped == 0


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_grad_scaler_unscales_and_skips_on_overflow(face):
    x, y = _data(32, dtype=torch.float32)
    ref_model, amp_model = _mlp(torch.float32), _mlp(torch.float32)
    ref = _make(face, ref_model, approx="kfac")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    amp = _make(face, amp_model, approx="kfac", grad_scaler=scaler)
    for _ in range(2):
        ref.step(_closure(ref, ref_model, x, y))
        amp.step(_closure(amp, amp_model, x, y, scaler=scaler))
        scaler.update()
    # scaling by a power of two and unscaling is exact in floating point
    assert torch.allclose(_flat(ref_model), _flat(amp_model), atol=1e-6)
    # overflow: the scaled gradient becomes inf -> the step is skipped and the scale backs off
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)
    model = _mlp(torch.float32)
    opt = _make(face, model, approx="kfac", grad_scaler=scaler2)
    before = _flat(model)

    def overflowing():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        (scaler2.scale(loss) * 2.0 ** 100).backward()  # 2^200 overflows float32
        return loss, out

    opt.step(overflowing)
    scaler2.update()
    assert opt.num_amp_skipped == 1 and opt.num_skipped == 0
    assert torch.equal(_flat(model), before)
    assert scaler2.get_scale() < 2.0 ** 100


def test_grad_scaler_type_is_checked():
    with pytest.raises(TypeError, match="GradScaler"):
        SecondOrderOptimizer(_mlp(), grad_scaler=object())


def test_kfac_preconditioner_under_autocast_bfloat16():
    """The drop-in under torch.autocast(bfloat16): factors in float32 (or wider), a finite
    preconditioned gradient within bf16 error of the float32 one."""
    from torchsso2.kfac import KFACPreconditioner

    x, y = _data(32, dtype=torch.float32)
    grads = []
    for amp in (False, True):
        model = _mlp(torch.float32)
        pre = KFACPreconditioner(model, damping=1e-2, kl_clip=lambda step: None)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        pre.step()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        layers = pre.layers.values() if isinstance(pre.layers, dict) else pre.layers
        for layer in layers:
            assert layer.a_factor.dtype in (torch.float32, torch.float64)
            assert layer.g_factor.dtype in (torch.float32, torch.float64)
    assert torch.isfinite(grads[1]).all()
    assert (grads[1] - grads[0]).norm() < 0.05 * grads[0].norm()


def test_a_streak_of_skipped_steps_is_reported_as_an_error(caplog):
    x, y = _data(16, dtype=torch.float32)
    model = _mlp(torch.float32)
    opt = SecondOrderOptimizer(model, lr=0.1, curvature="fisher", approx="diag", damping=1e-2)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with caplog.at_level("WARNING", logger="torchsso2.optim.base"):
        for _ in range(10):
            opt.step(_closure(opt, model, bad, y))
    assert opt.num_skipped == 10
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "10 consecutive steps" in errors[0].getMessage()
