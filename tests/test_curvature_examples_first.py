"""The exact Fisher's blocks (every shape) and the empirical Fisher's full and diagonal blocks need each
covered module's first output dimension to hold the examples. A sequence-first ``[T, N, d]`` activation
of a batch-first model with ``T == N``, or a module broadcast over the examples whose size is N (a
position embedding on ``torch.arange(T)``, ``T == N``), passes a size check; one backward of the first
example's loss finds it (audits found the blocks silently wrong there: off by ~50%, and 2.9x)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature
from curvature import sequence
from torchsso2 import SecondOrderOptimizer
from optim_helpers import make_closure


class SeqFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [N, T, 3]; fc1 sees [T, N, 3]
        return self.fc2(torch.tanh(self.fc1(x.transpose(0, 1))).mean(0))


@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher"])
@pytest.mark.parametrize("approx", ["full", "diag"])
def test_a_sequence_first_activation_with_t_equal_n_is_refused(kind: str, approx: str) -> None:
    torch.manual_seed(0)
    model = SeqFirst().double()
    x, y = torch.randn(3, 3, 3, dtype=torch.float64), torch.randint(0, 3, (3,))
    with pytest.raises(ValueError, match=r"an example reaches other examples' entries of the first dimension of modules "
                                         r"\['fc1'\].*approx='kfac'"):
        curvature.compute(model, x, y, kind=kind, approx=approx)
    mixed = {"fc1": "kfac", "fc2": approx}
    if kind == "fisher":  # refused in every shape, as for T != N (the size check)
        with pytest.raises(ValueError, match=r"\['fc1'\]"):
            curvature.compute(model, x, y, kind=kind, approx=mixed)
    else:  # the empirical Fisher's K-FAC blocks sum per-row products: any layout
        c = curvature.compute(model, x, y, kind=kind, approx=mixed)
        assert torch.isfinite(c.dense()).all()


def test_batch_first_models_pass_and_are_checked_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked once per shape signature (a batch size seen before is not checked again); train-mode
    BatchNorm (frozen statistics) passes."""
    calls = []
    real = sequence.check_example_major_rows
    monkeypatch.setattr(sequence, "check_example_major_rows", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))  # train-mode BN
    opt = SecondOrderOptimizer(model, curvature="fisher", approx="diag")
    for n in (8, 8, 16, 8, 3):
        opt.step(make_closure(opt, model, torch.randn(n, 4), torch.randint(0, 3, (n,))))
    assert calls == [8, 16, 3]  # once per batch size


class Mixing(nn.Module):
    """A Linear whose outputs are mixed over the batch where the first example's loss does not see it: a running
    sum over the examples (example 0 sums itself alone), or a centring followed by a ReLU dead for example 0."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc1(x)
        if self.how == "cumsum":
            z = z.cumsum(0)
        else:
            z = z - z.mean(0)
            z = torch.relu(z - 100.0 * (torch.arange(len(x)) == 0).to(z.dtype)[:, None])  # example 0: dead
        return self.fc2(z)


@pytest.mark.parametrize("how", ["cumsum", "dead_first"])
@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher"])
def test_a_model_mixing_its_examples_past_the_first_is_refused(how: str, kind: str) -> None:
    """The check backpropagated the first example's loss only: a mixing that example does not reach passed, and
    the blocks came out wrong (up to 5× on a fuzzed model). Every example is checked (2·⌈log₂ N⌉ passes, once
    per shape)."""
    torch.manual_seed(0)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match=r"reaches other examples' entries of the first dimension of modules "
                                         r"\['fc1'\]"):
        curvature.compute(Mixing(how).double(), x, y, kind=kind, approx="full")


class ClassCentred(nn.Module):
    """Mixes its examples (a centring over the batch) and centres its output over the classes (which the softmax
    does not see): the Jacobian maps the ones vector to zero, so a backward of ones on the loss rows finds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        o = self.fc2(h - h.mean(0))
        return o - o.mean(1, keepdim=True)


def test_a_mixing_model_whose_output_is_centred_over_the_classes_is_refused() -> None:
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"reaches other examples' entries of the first dimension of modules"):
        curvature.compute(ClassCentred(), torch.randn(4, 3), torch.randint(0, 3, (4,)), kind="fisher", approx="diag")


def test_the_examples_first_check_runs_once_for_every_sequence_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its result depends on the examples and on which modules have them first, not on a sequence length that
    varies with dynamic padding: checked once, not at every new length."""
    calls = []
    real = sequence.check_example_major_rows
    monkeypatch.setattr(sequence, "check_example_major_rows", lambda *a, **k: calls.append(1) or real(*a, **k))

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(20, 4), nn.Linear(4, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids).mean(1))
    torch.manual_seed(0)
    model = Pooled()
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher", approx="diag")
    for t in (5, 7, 9, 5):
        ids, y = torch.randint(0, 20, (6, t)), torch.randint(0, 3, (6,))
        opt.step(make_closure(opt, model, ids, y), targets=y)
    assert len(calls) == 1


class PooledPositions(nn.Module):
    """A position embedding on arange(T) added to every example's tokens, pooled to one label each."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(7, 4), nn.Embedding(5, 4), nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head((self.tok(ids) + self.pos(torch.arange(ids.shape[1]))).mean(1))


@pytest.mark.parametrize("approx", ["kfac", "diag", "full"])
def test_a_broadcast_module_of_the_batch_size_is_refused_for_the_exact_fisher(approx: str) -> None:
    torch.manual_seed(0)
    ids, y = torch.randint(0, 7, (5, 5)), torch.randint(0, 3, (5,))  # T == N == 5
    with pytest.raises(ValueError, match=r"modules \['pos'\].*position embedding"):
        curvature.compute(PooledPositions(), ids, y, kind="fisher", approx=approx)
    ok = curvature.compute(PooledPositions(), ids, y, kind="fisher_mc", approx=approx)  # unbiased: no check
    assert torch.isfinite(ok.dense()).all()
