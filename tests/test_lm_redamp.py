"""A Levenberg–Marquardt damping change gives the current K-FAC eigen decompositions the new damping
in place (torchsso2/optim/redamp.py) instead of decomposing the factors again at the next step."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from curvature.blocks import KFACBlock
from curvature.linalg.torch_backend import TorchBackend
from torchsso2 import SecondOrderOptimizer
from torchsso2.optim.redamp import redamp
from optim_helpers import make_closure


def _setup(seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(32, 6, dtype=torch.float64), torch.randint(0, 3, (32,))
    args = dict(approx="kfac", damping=0.1, adaptive_damping=True, damping_adaptation_interval=2,
                curv_update_interval=3, inv_update_interval=50, seed=0)
    args.update(kw)
    opt = SecondOrderOptimizer(model, **args)
    return model, opt, make_closure(opt, model, x, y), (x, y)


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_damping_change_redamps_the_last_decomposition_without_eigh(monkeypatch, adaptive):
    kw = dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True) if adaptive else dict(lr=0.1, kl_clip=None)
    model, opt, closure, _ = _setup(**kw)
    opt.step(closure)  # step 0: estimate and decompose
    decomposed_at = {n: (b.left.clone(), b.right.clone()) for n, b in opt.running.blocks.items()}
    eighs = []
    original = TorchBackend._eigh
    monkeypatch.setattr(TorchBackend, "_eigh", lambda self, a: eighs.append(a.shape) or original(self, a))
    dampings = [opt.damping]
    for _ in range(11):  # LM every 2 steps, new factors every 3: no scheduled decomposition before step 50
        opt.step(closure)
        dampings.append(opt.damping)
    assert len(set(dampings)) > 2
    assert eighs == []  # neither the damping changes nor the new estimates decomposed anything
    for name, blk in opt.running.blocks.items():
        assert not torch.equal(blk.left, decomposed_at[name][0])  # the factors did move
        ref = KFACBlock(blk.layout, *decomposed_at[name])  # the factors of the last decomposition
        ref.decompose(opt.damping)  # with the current damping
        for key in ("ql", "qr"):
            assert torch.equal(blk.decomposition[key], ref.decomposition[key])
        torch.testing.assert_close(blk.decomposition["denom"], ref.decomposition["denom"], rtol=1e-12, atol=1e-15)


def test_redamp_is_all_or_nothing_and_leaves_saved_state_alone():
    model, opt, closure, _ = _setup(lr=0.1, kl_clip=None)
    opt.step(closure)
    saved = copy.deepcopy(opt.state_dict())
    before = {n: b.decomposition["denom"] for n, b in opt.running.blocks.items()}
    assert redamp(opt.running.blocks, 0.1, 0.05)
    for n, b in opt.running.blocks.items():
        torch.testing.assert_close(b.decomposition["denom"], before[n] - 0.05)
        assert b.decomposition["denom"] is not before[n]  # replaced, not written into
    assert not redamp(opt.running.blocks, 0.05, -1e9)  # would make denom non-positive: nothing changes
    for n, b in opt.running.blocks.items():
        torch.testing.assert_close(b.decomposition["denom"], before[n] - 0.05)
    inverse = _setup(lr=0.1, kl_clip=None, kfac_method="inverse")
    inverse[1].step(inverse[2])
    assert not redamp(inverse[1].running.blocks, 0.1, 0.2)  # an inverse is not re-damped: decomposed again
    assert not redamp({}, 0.1, 0.2)
    other = _setup(lr=0.1, kl_clip=None)[1]
    other.load_state_dict(saved)  # the state_dict taken before redamp still has the old denominators
    for n, b in other.running.blocks.items():
        torch.testing.assert_close(b.decomposition["denom"], before[n])


def test_inverse_method_still_decomposes_again_after_a_damping_change():
    model, opt, closure, _ = _setup(lr=0.1, kl_clip=None, kfac_method="inverse")
    for _ in range(2):
        opt.step(closure)
    assert opt.damping != 0.1 and opt._redamp_pending  # LM changed it at step 1: decompose at step 2


def test_adaptive_checkpoint_across_redamps_resumes_bit_exactly():
    kw = dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True)
    model, opt, closure, (x, y) = _setup(**kw)
    for _ in range(5):
        opt.step(closure)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for _ in range(7):
        opt.step(closure)
    clone, other, _, _ = _setup(seed=3, **kw)
    clone.load_state_dict(saved_model)
    other.load_state_dict(saved_opt)
    closure2 = make_closure(other, clone, x, y)
    for _ in range(7):
        other.step(closure2)
    assert other.damping == opt.damping
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)
