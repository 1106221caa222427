"""The LM rule's second closure call (``adaptive_damping`` without ``targets=``) replays what the step's
call drew from Python's ``random`` and NumPy's global generator as well as torch's (an augmentation
drawn in the closure): the loss after the update is measured on the step's own batch, and the
streams are left as one call per step leaves them."""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer


@pytest.mark.parametrize("adaptive, targets, smoothing", [
    (False, False, 0.0), (True, False, 0.0),
    (False, True, 0.0),  # adaptive_damping alone calls the closure again, targets or not
    (True, True, 0.1),   # a loss that is not the mean NLL of the output: the closure again, not one forward
], ids=["lm", "adaptive", "lm-targets", "adaptive-targets-smoothing"])
def test_second_call_sees_the_steps_own_augmentation(adaptive: bool, targets: bool, smoothing: float) -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    kw = dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True) if adaptive else dict(lr=0.05)
    opt = SecondOrderOptimizer(model, seed=1, adaptive_damping=True, damping_adaptation_interval=1, **kw)
    np.random.seed(0)
    random.seed(0)
    seen = []

    def closure():
        opt.zero_grad()
        s = np.random.randn() * 0.1 + random.random() * 0.01
        seen.append(s)
        out = model(x * (1 + s))
        loss = F.cross_entropy(out, y, label_smoothing=smoothing)
        loss.backward()
        return loss, out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            opt.step(closure, targets=y if targets else None)
    after_steps = (np.random.randn(), random.random())  # the streams' next draws after the training
    np.random.seed(0)
    random.seed(0)
    one_call_per_step = [np.random.randn() * 0.1 + random.random() * 0.01 for _ in range(5)]
    assert len(seen) == 10  # the step's call and the LM rule's, at every step
    assert seen[0::2] == one_call_per_step  # the streams as one call per step leaves them
    assert seen[1::2] == seen[0::2]  # the second call replays the first's draws
    assert after_steps == (np.random.randn(), random.random())  # one call per step's streams continue the same
