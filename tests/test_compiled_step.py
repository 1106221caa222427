"""A function that calls ``opt.step(closure)`` (or ``VIOptimizer.predict``) under ``torch.compile``
gives the eager results: the step and ``predict`` run eagerly there (``torch.compiler.disable``;
torchsso2/optim/precision.py, vi_shift.py, vi_predict.py). Before, dynamo's trace of VI's in-place
parameter swaps left a weight sample in the model after the step (1.27 from the eager weights on
this model, not 0.004), evaluated predict's antithetic samples at the wrong weights, and the traced
``torch._fused_sgd_`` of the momentum update crashed the second step after the curvature had taken
the batch in."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer

X, Y = torch.randn(32, 8, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 3

#: the optimizer, its arguments and the compile backend (the fused momentum crashed under inductor only)
CASES = {
    "vi-diag": (VIOptimizer, dict(dataset_size=100), "eager"),
    "vi-kfac-2-samples": (VIOptimizer, dict(dataset_size=100, approx="kfac", num_mc_samples=2), "eager"),
    "sso-kfac-momentum": (SecondOrderOptimizer, dict(lr=0.1), "inductor"),
}


def _run(cls, kw, backend: str, compiled: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = cls(model, seed=0, **kw)

    closure = make_closure(opt, model, X, Y)

    def train():
        return opt.step(closure)

    step = torch.compile(train, backend=backend) if compiled else train
    for _ in range(3):
        step()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    if cls is not VIOptimizer:
        return params, None

    def predict():
        return opt.predict(X, num_samples=4, generator=torch.Generator().manual_seed(1))
    return params, (torch.compile(predict, backend=backend) if compiled else predict)()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_compiled_function_calling_step_matches_eager(case):
    cls, kw, backend = CASES[case]
    try:
        eager, eager_pred = _run(cls, kw, backend, compiled=False)
        compiled, compiled_pred = _run(cls, kw, backend, compiled=True)
    finally:
        torch._dynamo.reset()
    assert torch.equal(eager, compiled)
    if eager_pred is not None:
        assert torch.equal(eager_pred, compiled_pred)
