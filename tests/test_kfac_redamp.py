"""K-FAC eigen decompositions keep the factors' eigendecompositions while the factors are unchanged:
a new damping or scale recomputes only ``denom`` (curvature/blocks/kfac.py ``_factor_eigs``).
The fast path must equal a full decomposition, in a block and in a training run."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from curvature.blocks import KFACBlock
from curvature.linalg.torch_backend import TorchBackend
from torchsso2 import SecondOrderOptimizer
from optim_helpers import make_closure


@pytest.fixture
def eigh_calls(monkeypatch):
    calls = []
    original = TorchBackend._eigh

    def counting(self, a):
        calls.append(tuple(a.shape))
        return original(self, a)

    monkeypatch.setattr(TorchBackend, "_eigh", counting)
    return calls


def _trained_opt(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    x, y = torch.randn(32, 6, dtype=dtype), torch.randint(0, 3, (32,))
    opt = SecondOrderOptimizer(model, approx="kfac", lr=0.1, damping=0.1, kl_clip=None, seed=0, **kw)
    return model, opt, make_closure(opt, model, x, y), (x, y)


def _fresh_copy(blk: KFACBlock) -> KFACBlock:
    return KFACBlock(blk.layout, blk.left.clone(), blk.right.clone())


def _dense_solve(blk: KFACBlock, damping: float, scale: float, vecs):
    c = scale * blk.dense() + damping * torch.eye(blk.dense().shape[0], dtype=blk.left.dtype)
    flat = torch.cat([v.reshape(-1) for v in vecs])
    # the block's dense() orders entries as the parameters' flattened concatenation
    sol = torch.linalg.solve(c, flat)
    out, i = [], 0
    for v in vecs:
        out.append(sol[i:i + v.numel()].view_as(v))
        i += v.numel()
    return out


def test_new_damping_reuses_the_eigendecompositions_and_equals_a_full_decomposition(eigh_calls):
    _, opt, closure, _ = _trained_opt()
    opt.step(closure)
    for blk in opt.running.blocks.values():
        blk.decompose(0.1)
        eigh_calls.clear()
        blk.decompose(0.37, scale=2.0)  # damping and scale changed, factors not
        assert eigh_calls == []
        ref = _fresh_copy(blk)
        ref.decompose(0.37, scale=2.0)
        for k in ("ql", "qr", "denom"):
            assert torch.equal(blk.decomposition[k], ref.decomposition[k]), k
        vecs = [torch.randn_like(p) for p in blk.layout.params]
        for got, want in zip(blk.solve(vecs), _dense_solve(blk, 0.37, 2.0, vecs)):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_a_changed_factor_is_decomposed_again(eigh_calls):
    _, opt, closure, _ = _trained_opt()
    opt.step(closure)
    blk = next(iter(opt.running.blocks.values()))
    blk.decompose(0.1)
    blk.left.mul_(3.0)  # in place: the cached eigendecomposition is stale
    eigh_calls.clear()
    blk.decompose(0.1)
    assert len(eigh_calls) == 2
    ref = _fresh_copy(blk)
    ref.decompose(0.1)
    assert torch.equal(blk.decomposition["denom"], ref.decomposition["denom"])
    blk.right = blk.right.clone()  # replaced: decomposed again too
    eigh_calls.clear()
    blk.decompose(0.1)
    assert len(eigh_calls) == 2
    eigh_calls.clear()
    blk.decompose(0.1, dtype=torch.float32)  # another compute dtype: decomposed again, in that dtype
    assert len(eigh_calls) == 2 and blk.decomposition["ql"].dtype == torch.float32


def test_training_with_lm_damping_equals_the_always_decomposing_path(monkeypatch, eigh_calls):
    """10/100 intervals with LM damping, where every damping change re-decomposes at a step without a
    new estimate (the path of blocks that torchsso2/optim/redamp.py cannot re-damp in place; forced
    here). The cached path must give bit-identical parameters to a run that always calls eigh."""
    monkeypatch.setattr("torchsso2.optim.second_order.redamp", lambda *args, **kwargs: False)
    model, opt, closure, (x, y) = _trained_opt(adaptive_damping=True, damping_adaptation_interval=2,
                                               curv_update_interval=10, inv_update_interval=100)
    model_ref, opt_ref = copy.deepcopy((model, opt))
    closure_ref = make_closure(opt_ref, model_ref, x, y)
    dampings = []
    for _ in range(12):
        opt.step(closure)
        dampings.append(opt.damping)
    assert len(set(dampings)) > 2  # the damping did change several times
    cached = len(eigh_calls)
    eigh_calls.clear()
    with monkeypatch.context() as m:  # the general path: every decomposition computes its eigh
        m.setattr(KFACBlock, "_factor_eigs", lambda self, backend, dtype: tuple(
            self._eig(f, backend, dtype) for f in (self.left, self.right)))
        for _ in range(12):
            opt_ref.step(closure_ref)
    assert opt_ref.damping == opt.damping
    assert cached < len(eigh_calls)  # the cached run skipped some eigh
    for p, q in zip(model.parameters(), model_ref.parameters()):
        assert torch.equal(p, q)


def test_a_deepcopied_cache_starts_empty():
    """``copy.deepcopy`` restarts the copied sources' version counters, so a copied cache could take
    a later in-place write of the copy for "unchanged" (a VIOptimizer twin used a stale eigenbasis)."""
    import copy

    from curvature.blocks.base import DerivedCache

    src = torch.ones(3)
    for _ in range(3):
        src.add_(1)  # the source's version counter: 3
    cache = DerivedCache()
    assert cache.get([src], lambda: float(src.sum())) == 12.0
    src2, cache2 = copy.deepcopy((src, cache))
    assert src2._version < src._version  # the copy's counter restarts
    writes = 0
    while src2._version < src._version:  # in-place writes of the copy until its counter is the cached one
        src2.add_(1)
        writes += 1
    assert cache2.get([src2], lambda: float(src2.sum())) == 3.0 * (4 + writes)
    assert cache.get([src], lambda: float(src.sum())) == 12.0


def test_a_new_damping_keeps_the_solve_plans_bases_and_solves_the_new_system():
    """After a solve, a damping change (the LM rule's redamp: a new ``denom`` with the same
    eigenbases) rebuilds only the damping-dependent part of the solve plan: the row-major copies of
    the bases are the same tensors, and the solve is the dense solve with the new damping; new
    factors give new bases."""
    from torchsso2.optim.redamp import redamp
    _, opt, closure, _ = _trained_opt()
    opt.step(closure)
    blocks = opt.running.blocks
    for blk in blocks.values():
        blk.decompose(0.1)
    vecs = {n: [torch.randn_like(p) for p in blk.layout.params] for n, blk in blocks.items()}
    before = {}
    for n, blk in blocks.items():
        blk.solve(vecs[n])
        before[n] = blk._solve_plan(blk.decomposition)["direct"]
    assert redamp(blocks, 0.1, 0.37)
    for n, blk in blocks.items():
        for got, want in zip(blk.solve(vecs[n]), _dense_solve(blk, 0.37, 1.0, vecs[n])):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
        plan = blk._solve_plan(blk.decomposition)
        assert plan["direct"] is not before[n]  # the damping-dependent part is new
        assert all(a is b for a, b in zip(plan["direct"][4], before[n][4]))  # the bases' columns are kept
        blk.left = blk.left * 2.0  # new factors: new bases
        blk.decompose(0.37)
        fresh = blk._solve_plan(blk.decomposition)
        assert not any(a is b for a, b in zip(fresh["direct"][4], before[n][4]))
        for got, want in zip(blk.solve(vecs[n]), _dense_solve(blk, 0.37, 1.0, vecs[n])):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
