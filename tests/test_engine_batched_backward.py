"""The exact Fisher backpropagates the K columns of √H in one vmapped backward; the fallback
(one backward per column) must give the same blocks, and the batched path must really run."""
from __future__ import annotations

import pytest
import torch

import curvature
from curvature.engine import CurvatureEngine
from models import MODELS


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("approx", ["diag", "kfac", "full"])
def test_batched_backward_equals_loop(model_name: str, approx: str, monkeypatch: pytest.MonkeyPatch) -> None:
    build, batch = MODELS[model_name]
    x, y = batch(4, "cross_entropy", seed=1)
    calls = []
    original = CurvatureEngine._batched_output_grads

    def spy(*args):
        out = original(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(CurvatureEngine, "_batched_output_grads", staticmethod(spy))
    batched = curvature.compute(build(), x, y, kind="fisher", approx=approx)
    assert calls, "the exact Fisher (K = 3 classes) must try the batched backward"
    assert all(calls), f"{model_name}: the batched backward fell back to the loop"
    monkeypatch.setattr(CurvatureEngine, "_batched_output_grads", staticmethod(lambda *a: None))
    looped = curvature.compute(build(), x, y, kind="fisher", approx=approx)
    for name, blk in batched.blocks.items():
        torch.testing.assert_close(blk.dense(), looped.blocks[name].dense(), rtol=1e-12, atol=1e-12)
