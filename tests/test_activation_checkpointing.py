"""Activation checkpointing (``torch.utils.checkpoint``) inside the model.

Non-reentrant checkpointing recomputes a region's forward during the backward pass: the capture
keeps the record of the original call and ignores the recomputation, so every kind × shape of both
optimizers (and ``curvature.compute``) gives the same result as the model without checkpointing —
bit for bit, since the recomputation repeats the same ops on the same values. Reentrant
checkpointing runs the region's forward under ``no_grad``: the kinds that run their own backward
passes through the recorded outputs cannot see it (a ``ValueError`` names
``use_reentrant=False``); the empirical Fisher from the user's own backward records the
recomputation and works with it.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import curvature
from optim_helpers import kfac_sgd_train, make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer

X = torch.randn(6, 2, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
Y = torch.randint(0, 4, (6,), generator=torch.Generator().manual_seed(1))


class Block(nn.Module):
    """Residual block: conv → norm → ReLU → 1×1 conv, added to the input."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.norm = nn.BatchNorm2d(3) if norm == "batch" else nn.LayerNorm([3, 4, 4])
        self.proj = nn.Conv2d(3, 3, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(torch.relu(self.norm(self.conv(x))))


class Net(nn.Module):
    """Conv → checkpointed residual block (``mode``: None, "nonreentrant", "reentrant") → Linear."""

    def __init__(self, mode: str = None, norm: str = "batch") -> None:
        super().__init__()
        self.inp = nn.Conv2d(2, 3, 3, padding=1)
        self.block = Block(norm)
        self.out = nn.Linear(48, 4)
        self.mode = mode

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.inp(x))
        if self.mode is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.mode == "reentrant")
        return self.out(h.flatten(1))


def _net(mode: str = None, norm: str = "batch") -> Net:
    torch.manual_seed(3)
    return Net(mode, norm).double()


def _train(make_opt, mode: str, norm: str = "batch", steps: int = 3, targets: bool = False) -> Tensor:
    model = _net(mode, norm)
    opt = make_opt(model)
    closure = make_closure(opt, model, X, Y)
    for _ in range(steps):
        if targets:
            opt.step(closure, targets=Y)
        else:
            opt.step(closure)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _start(norm: str = "batch") -> Tensor:
    return torch.cat([p.detach().flatten() for p in _net(None, norm).parameters()])


SECOND_ORDER: List[Dict] = [dict(approx=a, curvature=c, lr=0.1, damping=1.0, seed=0)
                            for a in ("kfac", "diag", "full") for c in ("fisher", "fisher_mc", "empirical_fisher")]
SECOND_ORDER += [dict(approx=a, curvature="hessian", lr=0.1, damping=10.0) for a in ("diag", "full")]
SECOND_ORDER += [dict(approx="kfac", damping=0.1, adaptive_damping=True, use_adaptive_learning_rate=True,
                      use_adaptive_momentum=True, seed=0)]


def _forward_ad_through_checkpoint() -> bool:
    """Whether this torch runs forward-mode AD through ``checkpoint(use_reentrant=False)`` (adaptive mode's J·v;
    torch 2.5 and older: a NotImplementedError, which the adaptive step names)."""
    import torch.autograd.forward_ad as fwAD
    try:
        with fwAD.dual_level():
            checkpoint(nn.Linear(2, 2), fwAD.make_dual(torch.randn(1, 2), torch.randn(1, 2)), use_reentrant=False)
    except NotImplementedError:
        return False
    return True


@pytest.mark.parametrize("norm", ["batch", "layer"])
@pytest.mark.parametrize("kwargs", SECOND_ORDER, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_second_order_nonreentrant_equals_plain_model(kwargs, norm):
    targets = kwargs.get("curvature") == "hessian" or "use_adaptive_learning_rate" in kwargs
    if "use_adaptive_learning_rate" in kwargs and not _forward_ad_through_checkpoint():
        pytest.skip("this torch has no forward-mode AD through checkpoint(use_reentrant=False)")
    plain = _train(lambda m: SecondOrderOptimizer(m, **kwargs), None, norm, targets=targets)
    ckpt = _train(lambda m: SecondOrderOptimizer(m, **kwargs), "nonreentrant", norm, targets=targets)
    assert (plain - _start(norm)).abs().max() > 1e-3  # the steps moved the weights
    assert torch.equal(plain, ckpt)


@pytest.mark.parametrize("approx", ["diag", "kfac", "full"])
@pytest.mark.parametrize("curv", [None, "fisher"])
def test_vi_nonreentrant_equals_plain_model(approx, curv):
    kwargs = dict(approx=approx, dataset_size=100, seed=0, **({"curvature": curv} if curv else {}))
    plain = _train(lambda m: VIOptimizer(m, **kwargs), None)
    ckpt = _train(lambda m: VIOptimizer(m, **kwargs), "nonreentrant")
    assert (plain - _start()).abs().max() > 1e-3
    assert torch.equal(plain, ckpt)


@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher", "hessian"])
@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
def test_compute_nonreentrant_equals_plain_model(kind, approx):
    if kind == "hessian" and approx == "kfac":
        pytest.skip("K-FAC of the Hessian is not implemented")
    dense = [curvature.compute(_net(mode).train(), X, Y, kind=kind, approx=approx).dense()
             for mode in (None, "nonreentrant")]
    assert dense[0].abs().max() > 0
    assert torch.equal(dense[0], dense[1])


def test_attention_inside_nonreentrant_checkpoint():
    class Attn(nn.Module):
        def __init__(self, ckpt: bool) -> None:
            super().__init__()
            self.emb = nn.Linear(4, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)
            self.ckpt = ckpt

        def mix(self, h: Tensor) -> Tensor:
            return self.attn(h, h, h, need_weights=False)[0]

        def forward(self, x: Tensor) -> Tensor:
            h = self.emb(x)
            h = checkpoint(self.mix, h, use_reentrant=False) if self.ckpt else self.mix(h)
            return self.head(h.mean(1))

    x = torch.randn(5, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    y = torch.randint(0, 3, (5,), generator=torch.Generator().manual_seed(5))
    result = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = Attn(ckpt).double()
        opt = SecondOrderOptimizer(model, approx="kfac", lr=0.1, damping=0.1)
        for _ in range(3):
            opt.step(make_closure(opt, model, x, y))
        result.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(result[0], result[1])


def test_module_called_twice_still_refused():
    """Ignoring the recomputation must not let a layer genuinely reused in one forward through."""
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(torch.tanh(self.fc(x)))

    model = Twice().double()
    opt = SecondOrderOptimizer(model, approx="kfac")
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match="called more than once in one forward"):
        opt.step(make_closure(opt, model, x, y))


@pytest.mark.parametrize("curv", ["fisher", "fisher_mc"])
def test_reentrant_checkpointing_names_the_fix(curv):
    model = _net("reentrant")
    opt = SecondOrderOptimizer(model, approx="kfac", curvature=curv)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        opt.step(make_closure(opt, model, X, Y))


@pytest.mark.parametrize("approx", ["kfac", "diag"])
def test_reentrant_checkpointing_with_empirical_fisher_from_backward(approx):
    kwargs = dict(approx=approx, curvature="empirical_fisher", lr=0.1, damping=1.0)
    plain = _train(lambda m: SecondOrderOptimizer(m, **kwargs), None)
    ckpt = _train(lambda m: SecondOrderOptimizer(m, **kwargs), "reentrant")
    assert torch.equal(plain, ckpt)


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_kfac_preconditioner_with_checkpointing(mode):
    result = [kfac_sgd_train(_net(m), X, Y, factor_update_steps=1, inv_update_steps=2) for m in (None, mode)]
    assert torch.equal(result[0], result[1])


@pytest.mark.parametrize("make_opt", [
    lambda m: SecondOrderOptimizer(m, approx="kfac", curvature="fisher", lr=0.1, damping=1.0, seed=0),
    lambda m: SecondOrderOptimizer(m, approx="diag", curvature="fisher_mc", lr=0.1, damping=1.0, seed=0),
    lambda m: SecondOrderOptimizer(m, approx="full", curvature="hessian", lr=0.1, damping=10.0),
    lambda m: VIOptimizer(m, approx="kfac", dataset_size=100, seed=0),
    lambda m: SecondOrderOptimizer(m, approx="diag", curvature="hessian", damping=10.0, use_adaptive_learning_rate=True)],
    ids=["fisher-kfac", "fisher_mc-diag", "hessian-full", "vi-kfac", "hessian-diag-adaptive"])
def test_running_statistics_count_the_batch_as_torch_does(make_opt):
    """The curvature's own backward passes re-run the checkpointed block's forward; its training-mode
    BatchNorm must not count the batch again there (the exact Fisher's first step had counted it 9 times,
    the Monte-Carlo Fisher's 3; the adaptive learning rate's Hessian products more): torch's own recomputation in
    the user's backward counts it twice per step, and with a cumulative average (momentum=None) the statistics are
    then the plain model's."""
    stats = {}
    for mode in (None, "nonreentrant"):
        model = _net(mode)
        model.block.norm.momentum = None
        opt = make_opt(model)
        closure = make_closure(opt, model, X, Y)
        for _ in range(3):
            opt.step(closure, targets=Y) if isinstance(opt, SecondOrderOptimizer) else opt.step(closure)
        stats[mode] = {k: v.clone() for k, v in model.block.norm.state_dict().items()}
    assert int(stats[None]["num_batches_tracked"]) == 3
    assert int(stats["nonreentrant"]["num_batches_tracked"]) == 6
    for key in ("running_mean", "running_var"):
        torch.testing.assert_close(stats["nonreentrant"][key], stats[None][key], rtol=1e-12, atol=1e-14)
