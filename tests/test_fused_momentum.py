"""torchsso2/optim/fused_momentum.py: the momentum step with the KL clip's scale folded into one
``torch._fused_sgd_`` equals the scaled copy followed by the foreach momentum step
(:func:`torchsso2.optim.steps.momentum_step_`) up to float rounding, falls back to it where the
kernel does not apply, and never changes the gradients."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchsso2 import SecondOrderOptimizer
from torchsso2.optim.fused_momentum import scaled_momentum_step_
from torchsso2.optim.steps import momentum_step_
from optim_helpers import make_closure

SHAPES = [(8, 1, 3, 3), (8,), (4, 6), (4,)]


def _state(dtype, seed=0, first_use=False):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]
    states = [{} if first_use else {"momentum_buffer": torch.randn(s, generator=g, dtype=dtype)} for s in SHAPES]
    updates = [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]
    return params, states, updates


def _reference(params, states, updates, lrs, moms, scale):
    momentum_step_(params, [u * scale for u in updates], states, lrs, moms)


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("lrs,moms", [([0.3] * 4, [0.9] * 4),  # one group
                                      ([0.3, 0.3, 0.1, 0.1], [0.9, 0.9, 0.5, 0.0])])  # several, and momentum 0
def test_equals_the_scaled_copy_and_foreach_step(scale, lrs, moms):
    for first_use in (False, True):
        for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-14)):
            params, states, updates = _state(dtype, first_use=first_use)
            ref_p, ref_s = copy.deepcopy(params), copy.deepcopy(states)
            _reference(ref_p, ref_s, [u.clone() for u in updates], lrs, moms, scale)
            scaled_momentum_step_(params, [u.clone() for u in updates], states, lrs, moms, scale)
            for a, b in zip(params, ref_p):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)
            for a, b in zip(states, ref_s):
                assert a.keys() == b.keys()
                for k in a:
                    torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol)


def test_uses_one_fused_kernel_per_group(monkeypatch):
    """Existing float32 buffers of one (momentum, lr) take one ``torch._fused_sgd_``, clip or not;
    float64 with a binding clip and momentum 0 do not (the float32 ``grad_scale``; no buffer)."""
    calls = []
    real = torch._fused_sgd_
    monkeypatch.setattr(torch, "_fused_sgd_", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k)))
    for scale in (1.0, 0.5):
        params, states, updates = _state(torch.float32)
        scaled_momentum_step_(params, updates, states, [0.1] * 4, [0.9] * 4, scale)
    assert calls == [4, 4]
    params, states, updates = _state(torch.float64)
    scaled_momentum_step_(params, updates, states, [0.1] * 4, [0.9] * 4, 0.5)
    params, states, updates = _state(torch.float32)
    scaled_momentum_step_(params, updates, states, [0.1] * 4, [0.0] * 4, 0.5)
    assert calls == [4, 4]
    params, states, updates = _state(torch.float64)
    scaled_momentum_step_(params, updates, states, [0.1] * 4, [0.9] * 4, 1.0)
    assert calls == [4, 4, 4]


def test_kept_tensors_are_not_changed():
    """An update that is its gradient (a parameter outside every block) is copied before the in-place
    unscaling; other updates may be overwritten."""
    params, states, updates = _state(torch.float32)
    grads = [u.clone() for u in updates]
    keep = [updates[0], None, grads[2], grads[3]]  # updates[0] is "the gradient itself"
    before = updates[0].clone()
    ref_p, ref_s = copy.deepcopy(params), copy.deepcopy(states)
    _reference(ref_p, ref_s, [u.clone() for u in updates], [0.2] * 4, [0.9] * 4, 0.25)
    scaled_momentum_step_(params, updates, states, [0.2] * 4, [0.9] * 4, 0.25, keep)
    assert torch.equal(updates[0], before)
    for a, b in zip(params, ref_p):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_optimizer_with_a_binding_clip_keeps_the_gradients():
    """SecondOrderOptimizer with the last layer outside K-FAC (its update is ``p.grad`` itself) and a
    KL clip that binds at every step: the gradients after ``step`` are those of the backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    opt = SecondOrderOptimizer(model, lr=1.0, damping=0.01, curv_update_interval=2, inv_update_interval=4,
                               kl_clip=1e-6, skip_modules=["2"], seed=0)
    closure = make_closure(opt, model, x, y)
    for _ in range(5):
        before = copy.deepcopy(model)
        opt.step(closure)
        before.zero_grad()
        nn.functional.cross_entropy(before(x), y).backward()  # the gradients of the weights it started from
        for p, q in zip(model.parameters(), before.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters()))


def test_optimizer_plain_step_takes_the_fused_kernel(monkeypatch):
    """A K-FAC step after the first (buffers exist) updates all float32 parameters in one fused call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    opt = SecondOrderOptimizer(model, lr=0.3, damping=0.01, curv_update_interval=2, inv_update_interval=4,
                               kl_clip=1e-6, seed=0)
    closure = make_closure(opt, model, x, y)
    opt.step(closure)
    calls = []
    real = torch._fused_sgd_
    monkeypatch.setattr(torch, "_fused_sgd_", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k)))
    opt.step(closure)
    assert calls == [4]


def test_clip_scale_is_the_clip_factor():
    from torchsso2.optim.clipped_update import clip_scale
    from torchsso2.optim.steps import kl_clip_factor

    _, _, updates = _state(torch.float64)
    vecs = [u + 0.1 for u in updates]
    for clip in (1e-6, 1e6):
        assert clip_scale(updates, vecs, [0.1] * 4, clip) == pytest.approx(kl_clip_factor(updates, vecs, 0.1, clip),
                                                                           rel=1e-12)
    updates[1][0] = float("nan")
    assert clip_scale(updates, vecs, [0.1] * 4, 1e-3) is None


def test_devices_without_the_kernel_take_the_foreach_ops(monkeypatch):
    """Tensors on a device other than CPU/CUDA (here ``meta``) never reach ``torch._fused_sgd_``."""
    calls = []
    monkeypatch.setattr(torch, "_fused_sgd_", lambda *a, **k: calls.append(len(a[0])))
    params = [torch.empty(s, device="meta") for s in SHAPES]
    states = [{"momentum_buffer": torch.empty(s, device="meta")} for s in SHAPES]
    updates = [torch.empty(s, device="meta") for s in SHAPES]
    scaled_momentum_step_(params, updates, states, [0.1] * 4, [0.9] * 4, 1.0)
    assert calls == []
