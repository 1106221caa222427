"""Private torch kernels only where they equal the public path (issue #28 item 12).

``torch._fused_sgd_`` (VIOptimizer's momentum) is wrong on CPU in float16/bfloat16 (off by
~18 on values of order 1 in float16), so those dtypes take public ``torch._foreach_*`` ops; AMP's
non-finite kernel (``owned_all_finite``) is right in every dtype. End to end, SecondOrderOptimizer
and VIOptimizer steps on float16/bfloat16 parameters follow a float64 reference within the dtype's
rounding error."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import curvature
from curvature.blocks.base import all_finite, owned_all_finite
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.optim.steps import FUSED_SGD_DTYPES, natural_momentum_

HALF = [torch.float16, torch.bfloat16]
ALL = [torch.float64, torch.float32] + HALF
EPS = {dt: torch.finfo(dt).eps for dt in ALL}


class _Float32NoiseVI(VIOptimizer):
    """A VIOptimizer whose weight noise is drawn in float32 whatever the parameters' dtype."""

    @property
    def _noise_dtype(self) -> torch.dtype:
        return torch.float32


def _vectors(dtype, n=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", FUSED_SGD_DTYPES)
def test_fused_sgd_equals_the_public_ops_where_it_is_used(dtype):
    mean, grad, buf = _vectors(dtype)
    fused = buf.clone()
    torch._fused_sgd_([mean.clone()], [grad.clone()], [fused], weight_decay=0.01, momentum=0.9, lr=0.0,
                      dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
    public = buf.clone().mul_(0.9).add_(torch.add(grad, mean, alpha=0.01))
    torch.testing.assert_close(fused, public, rtol=4 * EPS[dtype], atol=4 * EPS[dtype])


@pytest.mark.parametrize("dtype", ALL)
def test_vi_momentum_matches_float64_in_every_dtype(dtype):
    mean, grad, buf = _vectors(dtype)
    states = [{"momentum_buffer": buf.clone()}]
    out = natural_momentum_(states, [grad], [mean], 0.01, [0.9])[0]
    exact = 0.9 * buf.double() + grad.double() + 0.01 * mean.double()
    assert out is states[0]["momentum_buffer"] and out.dtype == dtype
    # three roundings of values of order 1 in the dtype (the fused float16 kernel was off by ~18)
    assert (out.double() - exact).abs().max() <= 8 * EPS[dtype] * exact.abs().max()


@pytest.mark.parametrize("dtype", ALL)
def test_owned_finiteness_check_is_right_and_leaves_values_in_every_dtype(dtype):
    good = _vectors(dtype)
    copies = [t.clone() for t in good]
    assert owned_all_finite(good) and all(torch.equal(a, b) for a, b in zip(good, copies))
    for bad in (float("nan"), float("inf"), -float("inf")):
        tensors = [t.clone() for t in good]
        tensors[1][17] = bad
        assert not owned_all_finite(tensors) and not all_finite(tensors)


def _mlp(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    with torch.no_grad():  # start every dtype from the same (bfloat16-representable) weights
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    return model.to(dtype)


def _flat(model):
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def _train(face, approx, dtype, steps=5):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=g).to(torch.bfloat16).to(dtype)
    y = torch.randint(0, 3, (32,), generator=g)
    model = _mlp(dtype)
    if face == "sso":
        opt = SecondOrderOptimizer(model, lr=0.1, momentum=0.9, approx=approx, damping=0.1, seed=0)
    else:
        # the float64 reference draws the same (float32) standard normals as the half models
        opt = _Float32NoiseVI(model, dataset_size=1000, lr=0.05, momentum=0.9, approx=approx, prior_precision=1.0,
                              damping=100.0, seed=0, curvature_init=None, kl_clip=None)  # steps large enough to test

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        return loss, out

    for _ in range(steps):
        opt.step(closure)
    assert opt.num_skipped == 0
    return _flat(model)


@pytest.mark.parametrize("face", ["sso", "vi"])
@pytest.mark.parametrize("approx", ["kfac", "diag", "full"])
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 0.01), (torch.bfloat16, 0.03)])
def test_half_precision_steps_follow_the_float64_reference(face, approx, dtype, tol):
    ref = _train(face, approx, torch.float64)
    moved = (ref - _flat(_mlp(torch.float64))).norm()
    assert moved > 0.5
    got = _train(face, approx, dtype)
    # measured: 0.1% (float16) and 0.8% (bfloat16) of the distance moved; the fused momentum kernel: 27-43%
    assert (got - ref).norm() < tol * moved


# ---- found by an audit of half-precision models (no autocast) ---------------------------------------
def _half_mlp(dtype, scale=1.0, centre=False):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(4, 5), nn.Linear(5, 3)

        def forward(self, x):
            h = self.l1(x)
            if centre:  # couples the examples (not a BatchNorm)
                h = h - h.mean(0)
            return self.l2(torch.tanh(h))
    model = Net()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)) * scale
    y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))
    return model, model.to(dtype), x.to(dtype), y


def test_hessian_diagonal_of_a_float16_model_with_large_inputs_is_finite():
    """x² overflows float16 at |x| > 256: the fast diagonal squares in float32 (it had 30 of 53 inf/nan)."""
    _, model, x, y = _half_mlp(torch.float16, scale=300.0)
    diag = curvature.compute(model, x, y, kind="hessian", approx="diag").dense().diagonal()
    full = curvature.compute(model, x, y, kind="hessian", approx="full").dense().diagonal()
    assert torch.isfinite(diag).all()
    assert (diag - full).abs().max() <= 2e-2 * full.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hessian_diagonal_of_a_half_model_sees_coupled_examples(dtype):
    """A model centring over the batch couples the examples; in half precision the coupling probe's
    tolerance hid it and the diagonal came out all zeros: now the generic path (its own rounding)."""
    ref_model, model, x, y = _half_mlp(dtype, centre=True)
    ref_model = copy.deepcopy(model).double()
    expected = curvature.compute(ref_model, x.double(), y, kind="hessian", approx="diag").blocks["l1"].dense()
    got = curvature.compute(model, x, y, kind="hessian", approx="diag").blocks["l1"].dense().double()
    assert expected.abs().max() > 1e-2
    assert (got - expected).abs().max() <= 5e-2 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mse_monte_carlo_fisher_of_a_half_model_with_large_outputs(dtype):
    """The Gaussian MC vectors are −ε (not f − (f + ε), which rounds ε to f's ulp: 31% off in bfloat16 for
    outputs near 300), drawn in float64 (a float32 model and its float64 copy draw the same numbers)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.bias.fill_(300.0)
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(1))
    exact = curvature.compute(copy.deepcopy(model).double(), x.double(), torch.zeros(16, 2, dtype=torch.float64),
                              loss="mse", kind="fisher", approx="full").dense()
    mc = curvature.compute(copy.deepcopy(model).to(dtype), x.to(dtype), torch.zeros(16, 2, dtype=dtype), loss="mse",
                           kind="fisher_mc", approx="full", mc_samples=2000,
                           generator=torch.Generator().manual_seed(3)).dense().double()
    assert abs(float(mc.trace() / exact.trace()) - 1.0) < 0.05
    same = [curvature.compute(copy.deepcopy(model).to(dt), x.to(dt), torch.zeros(16, 2, dtype=dt), loss="mse",
                              kind="fisher_mc", approx="diag", generator=torch.Generator().manual_seed(3)).dense()
            for dt in (torch.float32, torch.float64)]
    torch.testing.assert_close(same[0].double(), same[1], rtol=1e-5, atol=1e-6)
