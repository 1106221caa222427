"""Findings of a mixed-precision and dtype audit: the optimizer state follows ``model.double()`` after
some steps, the AMP recipe with ``adaptive_damping``, and the decomposition hint for the Hessian."""
from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer


def _step(opt, model, i: int) -> None:
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(16, 6, generator=gen).to(next(model.parameters()).dtype)
    y = torch.randint(0, 4, (16,), generator=gen)
    opt.step(make_closure(opt, model, x, y))


@pytest.mark.parametrize("face", ["so", "vi"])
def test_state_follows_model_double_after_some_steps(face: str) -> None:
    """model.double() after 2 steps: momentum buffers, the running curvature and its decompositions move to
    float64 as a checkpoint loaded into the converted model gives them, before the step's closure draws
    VI's weight noise: bit-exact against that reference (SecondOrderOptimizer kept float32 buffers, both
    faces float32 curvature: 6.7e-7 off after 28 steps, float32's precision)."""
    def make(model):
        if face == "so":
            return SecondOrderOptimizer(model, lr=0.05, damping=0.05, approx="kfac", seed=0)
        return VIOptimizer(model, dataset_size=100, lr=0.01, approx="kfac", init_precision=50.0, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))
    opt = make(model)
    for i in range(2):
        _step(opt, model, i)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    ref_model = copy.deepcopy(model).double()
    ref = make(ref_model)
    ref.load_state_dict(torch.load(saved, weights_only=False))
    model.double()
    for i in range(2, 12):
        _step(opt, model, i)
        _step(ref, ref_model, i)
    for blk in opt.running.blocks.values():
        assert all(t.dtype == torch.float64 for t in blk.tensors())
        assert all(v.dtype == torch.float64 for v in blk.decomposition.values() if isinstance(v, torch.Tensor))
    assert all(v.dtype == torch.float64 for p in model.parameters() for v in opt.state[p].values()
               if isinstance(v, torch.Tensor) and v.is_floating_point())
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_amp_recipe_with_adaptive_damping_names_the_second_unscale() -> None:
    """The guide's AMP closure (scaler.unscale_ to clip) with adaptive_damping: the LM rule's second closure
    call makes torch refuse a second unscale_; the error says why and what to do (torch's own message only
    said unscale_ had been called)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    scaler = torch.amp.GradScaler("cpu")
    opt = SecondOrderOptimizer(model, grad_scaler=scaler, adaptive_damping=True, damping_adaptation_interval=1)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))

    def closure():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = F.cross_entropy(out, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        return loss, out
    with pytest.raises(RuntimeError, match="adaptive_damping calls the closure a second time.*do not unscale"):
        opt.step(closure)


def test_failed_hessian_decomposition_hint_is_damping_not_precision(caplog) -> None:
    """An indefinite Hessian beyond the damping: the warning points to the damping (it suggested float64
    decompositions, which cannot help a negative eigenvalue)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(8, 3)
    y = model(x).detach() + 30.0 * torch.randn(8, 2)
    opt = SecondOrderOptimizer(model, curvature="hessian", approx="diag", loss="mse", damping=1e-3, kl_clip=None)
    with caplog.at_level(logging.WARNING):
        opt.step(make_closure(opt, model, x, y, loss="mse"), targets=y)
    assert opt.num_skipped == 1
    assert "the Hessian may be indefinite: increase damping" in caplog.text and "decomposition_dtype" not in caplog.text
