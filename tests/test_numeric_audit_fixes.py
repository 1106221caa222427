"""Numerical edge cases: VI's reparam estimate under a large loss scale, the raise policy naming the
non-finite tensors, K-FAC of an unbatched Conv2d call, decomposition advice in float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvature.linalg import LinalgError, get_backend
from torchsso2 import NonFiniteError, SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner


def _vi_run(scale: float, steps: int = 6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10**6)
    opt = VIOptimizer(model, dataset_size=10**9, grad_scaler=scaler, seed=0)
    for _ in range(steps):
        def closure():
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            scaler.scale(loss).backward()
            return loss, out
        opt.step(closure)
        scaler.update()
    return opt, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_vi_reparam_estimate_is_unscaled_as_formed_so_a_large_scale_trains() -> None:
    big, params_big = _vi_run(2.0 ** 120)  # S·g finite, S·g·ε/σ² beyond float32
    small, params_small = _vi_run(2.0 ** 4)
    assert big.num_skipped == 0 and big.num_steps == 6
    torch.testing.assert_close(params_big, params_small)  # powers of two: the same steps


def test_the_raise_policy_names_the_non_finite_tensors() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    opt = SecondOrderOptimizer(model, on_nonfinite="raise")

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        model[2].bias.grad[0] = float("nan")
        return loss, out
    with pytest.raises(NonFiniteError, match=r"at step 0 \(.*2\.bias.*\); the optimizer state is unchanged"):
        opt.step(closure)


@pytest.mark.parametrize("out_channels,size", [(3, 4), (2, 6)])  # 3 outputs of 3×3: the silent case before
def test_kfac_of_an_unbatched_conv_call_equals_a_batch_of_one(out_channels: int, size: int) -> None:
    def factors(unbatched: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, out_channels, 2), nn.Flatten(0), nn.Linear(out_channels * (size - 1) ** 2, 3))
        pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
        x = torch.randn(2, size, size, generator=torch.Generator().manual_seed(1))
        out = model(x if unbatched else x[None]) if unbatched else model[2](model[0](x[None]).reshape(-1))
        F.cross_entropy(out[None], torch.tensor([1])).backward()
        pre.step()
        layer = pre.layers["0"]
        return layer.a_factor.clone(), layer.g_factor.clone()
    (a1, g1), (a2, g2) = factors(True), factors(False)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(g1, g2)


def test_a_failed_float64_decomposition_does_not_advise_float64() -> None:
    singular = -torch.eye(3, dtype=torch.float64)
    with pytest.raises(LinalgError) as err:
        get_backend("torch").cholesky(singular)
    assert "increase damping" in str(err.value) and "float64" not in str(err.value).split(";")[-1]
    with pytest.raises(LinalgError, match="or use dtype=torch.float64"):
        get_backend("torch").cholesky(singular.float())
