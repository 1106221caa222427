"""The exact and empirical Fisher's full and diagonal blocks need each covered module's first output
dimension to hold the examples. A sequence-first ``[T, N, d]`` activation of a batch-first model
with ``T == N`` passes a size check; one backward of the first example's loss finds it (an audit
found the blocks silently wrong there: off by ~50%)."""
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
    with pytest.raises(ValueError, match=r"first example reaches other entries of the first dimension of modules "
                                         r"\['fc1'\].*approx='kfac'"):
        curvature.compute(model, x, y, kind=kind, approx=approx)
    c = curvature.compute(model, x, y, kind=kind, approx={"fc1": "kfac", "fc2": approx})  # K-FAC sums every row
    assert torch.isfinite(c.dense()).all()


def test_batch_first_models_pass_and_are_checked_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked only where an output has the batch size at another dimension too (here the first
    layer's 8 features at batch 8), once per shape signature; train-mode BatchNorm (frozen
    statistics) passes."""
    calls = []
    real = sequence.check_example_major_rows
    monkeypatch.setattr(sequence, "check_example_major_rows", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))  # train-mode BN
    opt = SecondOrderOptimizer(model, curvature="fisher", approx="diag")
    for n in (8, 8, 16, 8, 3):
        opt.step(make_closure(opt, model, torch.randn(n, 4), torch.randint(0, 3, (n,))))
    assert calls == [8, 3]  # batch 8 (8 features), batch 3 (3 classes); not batch 16
