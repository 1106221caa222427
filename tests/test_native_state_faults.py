"""Smaller state faults of SecondOrderOptimizer and VIOptimizer (issue 33 item 6): freezing a layer
mid-run, copy.deepcopy, a float loss, an empty batch, model.double() after construction.
(BatchNorm statistics on a skipped step: tests/test_skip_semantics.py; absurd lr / dataset_size:
docs/validation.md's table.)"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from optim_helpers import batch, make_closure, param_vec, tiny_mlp
from torchsso2 import SecondOrderOptimizer, VIOptimizer


def _opt(face, model, approx="kfac", **kw):
    if face == "so":
        return SecondOrderOptimizer(model, lr=0.05, damping=0.05, curvature="fisher_mc", approx=approx, seed=1, **kw)
    return VIOptimizer(model, dataset_size=100, lr=0.01, approx=approx, init_precision=50.0, seed=1, **kw)


FACES = [("so", "kfac"), ("so", "diag"), ("so", "full"), ("vi", "kfac"), ("vi", "diag"), ("vi", "full")]


@pytest.mark.parametrize("face,approx", FACES)
def test_freezing_a_layer_mid_run(face, approx):
    """fc1.requires_grad_(False) after two steps: the steps go on, fc1 keeps its weights (VI: it is
    not sampled either) and its running curvature; fc2 trains; unfreezing resumes fc1."""
    model, (x, y) = tiny_mlp(), batch()
    opt = _opt(face, model, approx)
    for _ in range(2):
        opt.step(make_closure(opt, model, x, y))
    model.fc1.requires_grad_(False)
    w1, b1, w2 = model.fc1.weight.clone(), model.fc1.bias.clone(), model.fc2.weight.clone()
    stats = [t.clone() for t in opt.running.blocks["fc1"].tensors()]
    seen = []
    for _ in range(3):
        opt.step(make_closure(opt, model, x, y, record=seen))
    assert opt.num_skipped == 0
    assert torch.equal(model.fc1.weight, w1) and torch.equal(model.fc1.bias, b1)
    assert all(torch.equal(s["fc1.weight"], w1) for s in seen)  # the forward saw fc1's own weights
    assert all(torch.equal(a, b) for a, b in zip(opt.running.blocks["fc1"].tensors(), stats))
    assert not torch.equal(model.fc2.weight, w2)
    model.fc1.requires_grad_(True)
    opt.step(make_closure(opt, model, x, y))
    assert not torch.equal(model.fc1.weight, w1) and torch.isfinite(param_vec(model)).all()


@pytest.mark.parametrize("face", ["so", "vi"])
def test_deepcopy_gives_an_independent_working_optimizer(face):
    model, (x, y) = tiny_mlp(), batch()
    opt = _opt(face, model)
    for s in range(2):
        opt.step(make_closure(opt, model, *batch(seed=s)))
    twin = copy.deepcopy(opt)
    assert twin.num_steps == 2 and twin.model is not model
    assert torch.equal(param_vec(twin.model), param_vec(model))
    assert {id(p) for g in twin.param_groups for p in g["params"]} == {id(p) for p in twin.model.parameters()}
    for s in range(2, 5):
        xb, yb = batch(seed=s)
        opt.step(make_closure(opt, model, xb, yb))
        twin.step(make_closure(twin, twin.model, xb, yb))
    assert torch.equal(param_vec(twin.model), param_vec(model))  # same state and random streams
    assert twin.num_steps == opt.num_steps == 5
    model2, opt2 = copy.deepcopy((model, opt))
    assert opt2.model is model2
    opt2.step(make_closure(opt2, model2, x, y))
    assert opt.num_steps == 5 and not torch.equal(param_vec(model2), param_vec(model))


@pytest.mark.parametrize("face", ["so", "vi"])
def test_a_float_loss_from_the_closure_is_accepted_by_both_faces(face):
    model, (x, y) = tiny_mlp(), batch()
    opt = _opt(face, model)

    def closure(value=None):
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return (float(loss.detach()) if value is None else value), out
    loss, _ = opt.step(closure)
    assert float(loss) == pytest.approx(F.cross_entropy(model(x), y).item(), abs=1.0)
    assert opt.num_steps == 1 and opt.num_skipped == 0
    before = param_vec(model)
    opt.step(lambda: closure(float("nan")))  # a non-finite float loss is skipped like a tensor one
    assert opt.num_skipped == 1 and torch.equal(param_vec(model), before)
    with pytest.raises(TypeError, match="closure"):
        opt.step(lambda: ("1.0", model(x)))


@pytest.mark.parametrize("face", ["so", "vi"])
@pytest.mark.parametrize("kind", ["fisher_mc", "empirical_fisher"])
def test_an_empty_batch_is_a_clear_error(face, kind):
    model, (x, y) = tiny_mlp(), batch()
    if face == "so":
        opt = SecondOrderOptimizer(model, curvature=kind, seed=1)
    else:
        opt = VIOptimizer(model, dataset_size=100, curvature=kind, init_precision=50.0, seed=1)
    opt.step(make_closure(opt, model, x, y))
    before = param_vec(model)
    with pytest.raises(ValueError, match=r"empty batch \(output of shape \[0, 3\]\).*drop_last=True"):
        opt.step(make_closure(opt, model, x[:0], y[:0]))
    assert torch.equal(param_vec(model), before) and opt.num_steps == 1
    opt.step(make_closure(opt, model, x, y))
    assert opt.num_steps == 2


@pytest.mark.parametrize("approx", ["kfac", "diag", "full"])
def test_vi_after_model_double(approx):
    """A float32 model trained two steps, then model.double(): the steps go on in float64 (weight
    noise and momentum buffers follow the parameters' dtype)."""
    model, (x, y) = tiny_mlp(dtype=torch.float32), batch()
    opt = _opt("vi", model, approx)
    for _ in range(2):
        opt.step(make_closure(opt, model, x.float(), y))
    model.double()
    seen = []
    for _ in range(2):
        opt.step(make_closure(opt, model, x, y, record=seen))
    assert opt.num_skipped == 0 and opt.num_steps == 4
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(s["momentum_buffer"].dtype == torch.float64 for s in opt.state.values())
    assert torch.isfinite(param_vec(model)).all()
    assert not torch.equal(seen[-1]["fc1.weight"], model.fc1.weight)  # sampled: noise was drawn
    assert opt.predict(x, num_samples=2).dtype == torch.float64
