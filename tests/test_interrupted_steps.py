"""A step that does not finish (Ctrl-C in a notebook, an exception a training loop catches) leaves
each face as if it had not been called: training on gives the steps of a run without it.

Before: SecondOrderOptimizer's LM rule undid the update when its closure call raised but the running
curvature kept the batch; VIOptimizer did not give back the Monte-Carlo labels of a raising closure;
a Ctrl-C in a decomposition left blocks half-decomposed; KFACPreconditioner kept the factors its hooks
had folded (no public way to drop them) and a step interrupted in a decomposition kept both.
"""
from __future__ import annotations

import warnings
from typing import Callable, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(n: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def _closure(opt, model, x, y, fail_at: Optional[Callable[[int], bool]] = None):
    calls = {"n": 0}

    def closure():
        calls["n"] += 1
        if fail_at is not None and fail_at(calls["n"]):
            raise KeyboardInterrupt
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out
    return closure


def _params(model: nn.Module) -> List[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


FACES = {
    "lm": lambda m: SecondOrderOptimizer(m, adaptive_damping=True, damping_adaptation_interval=1),
    "adaptive": lambda m: SecondOrderOptimizer(m, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                                               adaptive_damping=True, damping_adaptation_interval=1),
    "vi_kfac_mc2": lambda m: VIOptimizer(m, dataset_size=1000, approx="kfac", num_mc_samples=2, seed=1),
}
#: the step interrupted: an LM step; VI's next estimating step after the first (curv_update_interval 10)
INTERRUPTED = {"lm": 2, "adaptive": 2, "vi_kfac_mc2": 10}


@pytest.mark.parametrize("face", sorted(FACES))
def test_a_closure_raising_in_the_later_calls_of_a_step_leaves_training_as_without_it(face: str) -> None:
    """The second closure call of the step raises: the LM rule's loss after the update, adaptive mode's
    (no targets: the closure again), VI's second weight sample (the first sample's labels were drawn)."""
    batches = _batches(INTERRUPTED[face] + 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference_model = _model()
        reference = FACES[face](reference_model)
        for x, y in batches:
            reference.step(_closure(reference, reference_model, x, y))
        model = _model()
        opt = FACES[face](model)
        for i, (x, y) in enumerate(batches):
            if i == INTERRUPTED[face]:
                with pytest.raises(KeyboardInterrupt):
                    opt.step(_closure(opt, model, x, y, fail_at=lambda n: n == 2))
            opt.step(_closure(opt, model, x, y))
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(p, q)
    assert opt.running.num_updates == reference.running.num_updates


def test_vi_default_diagonal_gives_back_the_batch_norm_statistics_of_a_raising_closure() -> None:
    """The default one-process diagonal step (vi_flat.py) restored the weights but not the running
    statistics the raising closure's forward had updated."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    batches = _batches(4)
    reference_model = make()
    reference = VIOptimizer(reference_model, dataset_size=64)
    for x, y in batches:
        reference.step(_closure(reference, reference_model, x, y))
    model = make()
    opt = VIOptimizer(model, dataset_size=64)
    for i, (x, y) in enumerate(batches):
        if i == 2:
            closure = _closure(opt, model, x, y)

            def raising():
                closure()
                raise KeyboardInterrupt
            with pytest.raises(KeyboardInterrupt):
                opt.step(raising)
        opt.step(_closure(opt, model, x, y))
    for p, q in zip(model.state_dict().values(), reference_model.state_dict().values()):
        assert torch.equal(p, q)


class _EighInterrupt:
    """``torch.linalg.eigh`` raising KeyboardInterrupt at its ``at``-th call (Ctrl-C in a decomposition)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int) -> None:
        self.calls, self.at, self.real = 0, at, torch.linalg.eigh
        monkeypatch.setattr(torch.linalg, "eigh", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.real(*args, **kwargs)


@pytest.mark.parametrize("face", ["second_order", "vi_kfac"])
def test_ctrl_c_in_a_decomposition_leaves_no_block_half_decomposed(face: str, monkeypatch) -> None:
    """The second block's eigendecomposition is interrupted: every block keeps its last decomposition
    (the first one's new decomposition is dropped), the update count is as before, the labels are given
    back, and the next step runs (the statistics keep the batch: documented in docs/guide.md)."""
    batches = _batches(3)
    model = _model()
    opt = SecondOrderOptimizer(model, lr=0.05) if face == "second_order" else \
        VIOptimizer(model, dataset_size=64, approx="kfac", curv_update_interval=1, inv_update_interval=1)
    for x, y in batches[:2]:
        opt.step(_closure(opt, model, x, y))
    decompositions = {name: blk.decomposition for name, blk in opt.running.blocks.items()}
    updates, generator = opt.running.num_updates, opt.generator.get_state()
    before = _params(model)
    patch = _EighInterrupt(monkeypatch, at=2)
    with pytest.raises(KeyboardInterrupt):
        opt.step(_closure(opt, model, *batches[2]))
    assert patch.calls == 2
    assert all(opt.running.blocks[n].decomposition is d for n, d in decompositions.items())
    assert opt.running.num_updates == updates and torch.equal(opt.generator.get_state(), generator)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    monkeypatch.setattr(torch.linalg, "eigh", patch.real)
    opt.step(_closure(opt, model, *batches[2]))
    assert opt.num_steps == 3


def _kfac_iteration(model, pre, sgd, x, y, fail: Optional[str] = None) -> None:
    sgd.zero_grad()
    for i in range(2):  # two micro-batches (accumulation_steps=2)
        out = model(x[8 * i:8 * (i + 1)])
        (F.cross_entropy(out, y[8 * i:8 * (i + 1)]) / 2).backward()
        if fail == f"after backward {i}":
            raise KeyboardInterrupt
    pre.step()
    sgd.step()


def _kfac_run(interrupt: Optional[str], monkeypatch=None):
    model = _model()
    pre = KFACPreconditioner(model, accumulation_steps=2, lr=0.1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(_batches(5)):
        if i == 2 and interrupt is not None:
            if interrupt == "eigh":
                patch = _EighInterrupt(monkeypatch, at=2)
                with pytest.raises(KeyboardInterrupt):
                    _kfac_iteration(model, pre, sgd, x, y)
                monkeypatch.setattr(torch.linalg, "eigh", patch.real)
            else:
                with pytest.raises(KeyboardInterrupt):
                    _kfac_iteration(model, pre, sgd, x, y, fail=interrupt)
                pre.abandon_step()
        _kfac_iteration(model, pre, sgd, x, y)
    return model, pre


@pytest.mark.parametrize("interrupt", ["after backward 0", "after backward 1", "eigh"])
def test_kfac_preconditioner_recovers_an_interrupted_iteration(interrupt: str, monkeypatch) -> None:
    """Between the micro-batches, after the folds of the last one (abandon_step() drops them; reset_batch()
    keeps kfac_pytorch's meaning), and inside step()'s decomposition (step() puts back the factors and the
    decompositions itself): the run goes on as without the interrupted iteration."""
    reference, ref_pre = _kfac_run(None)
    model, pre = _kfac_run(interrupt, monkeypatch)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert pre.steps == ref_pre.steps
