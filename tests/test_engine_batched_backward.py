"""The exact Fisher backpropagates the K columns of √H in one vmapped backward (models without
convolutions; those loop, which is faster there); the loop (one backward per column) must give the
same blocks, and the batched path must really run when it is chosen or forced."""
from __future__ import annotations

import pytest
import torch

import curvature
from curvature import engine as engine_module
from curvature.engine import CurvatureEngine
from curvature.modules import linear as linear_module
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
    monkeypatch.setattr(engine_module, "prefers_batched_backward", lambda model: True)
    batched = curvature.compute(build(), x, y, kind="fisher", approx=approx)
    assert calls, "the exact Fisher (K = C - 1 = 2 columns for 3 classes) must try the batched backward"
    assert all(calls), f"{model_name}: the batched backward fell back to the loop"
    monkeypatch.setattr(CurvatureEngine, "_batched_output_grads", staticmethod(lambda *a: None))
    looped = curvature.compute(build(), x, y, kind="fisher", approx=approx)
    for name, blk in batched.blocks.items():
        torch.testing.assert_close(blk.dense(), looped.blocks[name].dense(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_batched_backward_chosen_unless_convolutions(model_name: str) -> None:
    build, _ = MODELS[model_name]
    model = build()
    has_conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
    assert CurvatureEngine(model, kind="fisher", approx="diag").batched_backward is (not has_conv)


def test_conv_model_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    build, batch = MODELS["cnn"]
    x, y = batch(4, "cross_entropy", seed=1)
    calls = []
    monkeypatch.setattr(CurvatureEngine, "_batched_output_grads", staticmethod(lambda *a: calls.append(1)))
    curvature.compute(build(), x, y, kind="fisher", approx="diag")
    assert not calls


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("approx", ["diag", "kfac", "full"])
def test_looped_chunks_stack_to_the_same_blocks(model_name: str, approx: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The looped backward stacks its K per-vector gradients into chunks (one wide product per
    chunk); one vector per chunk, and one example per per-example product, give the same blocks."""
    build, batch = MODELS[model_name]
    x, y = batch(4, "cross_entropy", seed=1)
    monkeypatch.setattr(CurvatureEngine, "_batched_output_grads", staticmethod(lambda *a: None))
    stacked = curvature.compute(build(), x, y, kind="fisher", approx=approx)
    monkeypatch.setattr(engine_module, "_GRAD_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(linear_module, "DIAG_CHUNK_ELEMENTS", 1)
    single = curvature.compute(build(), x, y, kind="fisher", approx=approx)
    for name, blk in stacked.blocks.items():
        torch.testing.assert_close(blk.dense(), single.blocks[name].dense(), rtol=1e-12, atol=1e-12)


def test_looped_chunk_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 5 vectors with room for two per chunk: chunks of 2, 2 and 1 vectors, each holding the
    plain per-vector gradients in order."""
    build, batch = MODELS["cnn"]
    model = build()
    x, _ = batch(3, "cross_entropy", seed=2)
    eng = CurvatureEngine(model, kind="fisher", approx="diag")
    cap = eng.capture()
    with cap:
        out = model(x)
    vectors = torch.randn((5,) + tuple(out.shape), dtype=out.dtype, generator=torch.Generator().manual_seed(0))
    per_vector = sum(rec.output.numel() for rec in cap.records.values())
    monkeypatch.setattr(engine_module, "_GRAD_CHUNK_ELEMENTS", 2 * per_vector + 1)
    chunks = list(eng.output_grad_chunks(cap, out, vectors))
    assert [next(iter(c.values())).shape[0] for c in chunks] == [2, 2, 1]
    names = list(eng.layouts)
    outs = [cap.records[n].output for n in names]
    for i, name in enumerate(names):
        got = torch.cat([c[name] for c in chunks])
        want = torch.stack([torch.autograd.grad(out, outs, grad_outputs=v, retain_graph=True)[i] for v in vectors])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
