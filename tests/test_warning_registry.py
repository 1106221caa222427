"""The optimizers leave Python's once-per-location warning registry alone at every step: a warning the user's
closure raises under the ``"default"`` filter shows once, not once per step (``warnings.catch_warnings``' exit
resets that registry, so the per-step paths use none: the exact Fisher's batched backward, adaptive mode's
forward-mode products; the first step's one-time checks and imports may, once)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer

CASES = {
    "exact Fisher (batched backward)": lambda m: SecondOrderOptimizer(m, curvature="fisher"),
    "adaptive (forward-mode products)": lambda m: SecondOrderOptimizer(
        m, use_adaptive_learning_rate=True, use_adaptive_momentum=True, adaptive_damping=True),
    "empirical Fisher given targets": lambda m: SecondOrderOptimizer(m, curvature="empirical_fisher"),
    "VI diag": lambda m: VIOptimizer(m, dataset_size=100),
}


class _Net(nn.Module):
    """Not an ``nn.Sequential``: adaptive mode takes the generic forward-mode products (dual numbers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("case", list(CASES))
def test_a_user_warning_shows_once_over_steps(case: str) -> None:
    torch.manual_seed(0)
    model = _Net()
    opt = CASES[case](model)
    x, y = torch.randn(16, 4), torch.randint(0, 4, (16,))

    def closure():
        opt.zero_grad()
        out = model(x)
        warnings.warn("the user's own warning", UserWarning)  # one location: "default" shows it once
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step(closure, targets=y)  # the first step's one-time checks and imports
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(4):
            opt.step(closure, targets=y)
    assert sum("the user's own warning" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]
