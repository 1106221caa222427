"""VIOptimizer(curvature="reparam") with a ``grad_scaler``: IVON's estimate ``ĥ = g ⊙ ε/σ²`` takes the
unscaled gradient ``g`` (the closure's backward leaves ``S·g``), and an overflow skips the step.

The scale is a power of two, so scaling and unscaling are exact: the run with a scaler equals the
run without one (float64, tight tolerance). A scaler that forgot to unscale ĥ would multiply the
curvature by ``S = 2^10``.
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from optim_helpers import batch, param_vec, tiny_mlp
from torchsso2 import VIOptimizer

N_DATA = 100
STEPS = 4


def _closure(opt: VIOptimizer, model: torch.nn.Module, x: Tensor, y: Tensor, scaler: Any = None,
             factor: Callable[[], float] = lambda: 1.0) -> Callable[[], Tuple[Tensor, Tensor]]:
    def closure() -> Tuple[Tensor, Tensor]:
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        (loss if scaler is None else scaler.scale(loss) * factor()).backward()
        return loss, out
    return closure


def _curvature(opt: VIOptimizer) -> Tensor:
    return torch.cat([b.diagonal.reshape(-1) for b in opt.running.blocks.values()])


def _scaler(init_scale: float) -> Any:
    try:
        return torch.amp.GradScaler("cpu", init_scale=init_scale)
    except (RuntimeError, TypeError) as err:  # older torch without a CPU GradScaler
        pytest.skip(f"torch.amp.GradScaler('cpu') is not available: {err}")


@pytest.mark.parametrize("num_mc_samples", [1, 2])
def test_reparam_with_a_grad_scaler_equals_the_unscaled_run(num_mc_samples: int) -> None:
    x, y = batch()
    ref_model, amp_model = tiny_mlp(), tiny_mlp()
    kw = dict(dataset_size=N_DATA, curvature="reparam", approx="diag", num_mc_samples=num_mc_samples, seed=1)
    ref = VIOptimizer(ref_model, **kw)
    scaler = _scaler(2.0 ** 10)
    amp = VIOptimizer(amp_model, grad_scaler=scaler, **kw)
    assert amp.reparam
    for _ in range(STEPS):
        ref.step(_closure(ref, ref_model, x, y))
        amp.step(_closure(amp, amp_model, x, y, scaler))
        scaler.update()
    assert scaler.get_scale() == 2.0 ** 10  # no overflow: the scale never backed off
    assert amp.num_amp_skipped == 0 and amp.num_skipped == 0
    torch.testing.assert_close(_curvature(amp), _curvature(ref), rtol=1e-12, atol=0.0)
    torch.testing.assert_close(param_vec(amp_model), param_vec(ref_model), rtol=1e-12, atol=1e-14)
    assert (param_vec(amp_model) - param_vec(tiny_mlp())).abs().max() > 1e-4  # it trained


def test_reparam_overflow_skips_the_step_and_leaves_the_curvature() -> None:
    x, y = batch()
    model = tiny_mlp()
    scaler = _scaler(2.0 ** 10)
    opt = VIOptimizer(model, dataset_size=N_DATA, curvature="reparam", approx="diag", seed=1, grad_scaler=scaler)
    step = {"t": 0}
    closure = _closure(opt, model, x, y, scaler, factor=lambda: float("inf") if step["t"] == 2 else 1.0)
    for t in range(4):
        step["t"] = t
        params, curv = param_vec(model), _curvature(opt) if opt.running.blocks else None
        opt.step(closure)
        scale = scaler.get_scale()
        scaler.update()
        if t == 2:  # the scaled gradient is inf: the step is skipped, nothing moves, the scale backs off
            assert opt.num_amp_skipped == 1 and opt.num_skipped == 0
            assert torch.equal(param_vec(model), params) and torch.equal(_curvature(opt), curv)
            assert scaler.get_scale() < scale
        else:
            assert not torch.equal(param_vec(model), params)
        assert torch.isfinite(param_vec(model)).all() and torch.isfinite(_curvature(opt)).all()
