"""The hand-written J·v of plain ``nn.Sequential`` models (torchsso2/optim/sequential_jvp.py) against
torch.func.jvp (float64), and the adaptive step's Gram through it against the dual-number path."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from curvature.options import LossType
from torchsso2.optim import adaptive
from torchsso2.optim.adaptive import InputRecorder, ggn_gram
from torchsso2.optim.sequential_jvp import sequential_jvps, supports
from optim_helpers import make_closure


def _models():
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=False), nn.Tanh(), nn.AvgPool2d(2),
                        nn.Identity(), nn.Flatten(), nn.Linear(24, 5), nn.Sigmoid(), nn.Linear(5, 3, bias=False))
    mlp = nn.Sequential(nn.Linear(64, 7), nn.ReLU(), nn.Linear(7, 3))
    seq1d = nn.Sequential(nn.Unflatten(1, (2, 32)), nn.Conv1d(2, 3, 5, stride=2, padding=2),
                          nn.ReLU(), nn.MaxPool1d(3, stride=2, padding=1), nn.AvgPool1d(2), nn.Flatten(),
                          nn.Linear(12, 3))
    return {"cnn": cnn.double(), "mlp": mlp.double(), "conv1d": seq1d.double()}


@pytest.mark.parametrize("name", ["cnn", "mlp", "conv1d"])
@pytest.mark.parametrize("frozen", [False, True])
def test_sequential_jvps_equal_torch_func_jvp(name, frozen):
    model = _models()[name]
    x = torch.randn(10, 64, dtype=torch.float64)
    params = dict(model.named_parameters())
    moving = {n: p for i, (n, p) in enumerate(params.items()) if not (frozen and i == 0)}
    g = torch.Generator().manual_seed(1)
    dirs = [{n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in moving.items()} for _ in range(3)]
    assert supports(model, (x,), {})
    out, jv = sequential_jvps(model, x, {id(p): torch.stack([d[n] for d in dirs]) for n, p in moving.items()})
    assert jv.shape == (3, *out.shape)
    for i, d in enumerate(dirs):
        names = list(moving)
        f = lambda *ps: torch.func.functional_call(model, dict(zip(names, ps)), (x,))  # noqa: E731
        ref_out, ref_jv = torch.func.jvp(f, tuple(p.detach() for p in moving.values()), tuple(d[n] for n in names))
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(jv[i], ref_jv, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["cnn", "mlp", "conv1d", "seq3d"])
@pytest.mark.parametrize("moving_kind", ["weight", "bias", "alternate"])
def test_sequential_jvps_with_only_some_parameters_moving_equal_torch_func_jvp(name, moving_kind):
    """Every combination a layer can have: weight and bias tangents together (one addmm / one
    convolution with the bias tangents as its bias), a weight tangent alone, a bias tangent alone
    (broadcast), and none (only the incoming tangent); a Linear on a 3-d input takes the matmul path."""
    models = _models()
    torch.manual_seed(2)
    models["seq3d"] = nn.Sequential(nn.Linear(64, 6), nn.ReLU(), nn.Linear(6, 4)).double()  # on [N, L, 64]
    model = models[name]
    x = torch.randn(10, 5, 64, dtype=torch.float64) if name == "seq3d" else torch.randn(10, 64, dtype=torch.float64)
    params = dict(model.named_parameters())
    if moving_kind == "alternate":  # layer by layer: both, weight only, bias only, ...
        moving = {n: p for i, (n, p) in enumerate(params.items()) if i % 3 != 2}
    else:
        moving = {n: p for n, p in params.items() if n.endswith(moving_kind)}
    g = torch.Generator().manual_seed(3)
    dirs = [{n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in moving.items()} for _ in range(2)]
    assert supports(model, (x,), {})
    out, jv = sequential_jvps(model, x, {id(p): torch.stack([d[n] for d in dirs]) for n, p in moving.items()})
    names = list(moving)
    f = lambda *ps: torch.func.functional_call(model, dict(zip(names, ps)), (x,))  # noqa: E731
    for i, d in enumerate(dirs):
        ref_out, ref_jv = torch.func.jvp(f, tuple(p.detach() for p in moving.values()), tuple(d[n] for n in names))
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(jv[i], ref_jv, rtol=1e-10, atol=1e-12)


def test_relu_tangent_is_zero_where_the_input_is_not_positive():
    """The ReLU tangent (relu's backward kernel): the incoming tangent where the pre-activation is
    > 0, 0 where it is ≤ 0 (also at exactly 0, as forward mode takes it)."""
    lin = nn.Linear(2, 3).double()
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]]))
        lin.bias.zero_()
    model = nn.Sequential(lin, nn.ReLU())
    x = torch.tensor([[2.0, 1.0]], dtype=torch.float64)  # pre-activations 2, -2, 0
    tw = torch.ones(1, 3, 2, dtype=torch.float64)
    _, jv = sequential_jvps(model, x, {id(lin.weight): tw})
    torch.testing.assert_close(jv, torch.tensor([[[3.0, 0.0, 0.0]]], dtype=torch.float64))


def test_unsupported_models_take_the_dual_number_path():
    x = torch.randn(4, 6)
    plain = nn.Sequential(nn.Linear(6, 3))
    assert supports(plain, (x,), {})
    assert not supports(nn.Sequential(nn.Linear(6, 3), nn.Dropout(0.5)), (x,), {})
    assert not supports(nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)), (x,), {})
    assert not supports(nn.Sequential(nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect")), (x,), {})
    assert not supports(nn.Linear(6, 3), (x,), {})  # not a Sequential
    assert not supports(plain, (x, x), {}) and not supports(plain, (x,), {"y": 1})

    class MyLinear(nn.Linear):  # a subclass may compute something else
        pass
    assert not supports(nn.Sequential(MyLinear(6, 3)), (x,), {})
    hooked = nn.Sequential(nn.Linear(6, 3))
    hooked[0].register_forward_hook(lambda m, i, o: o * 2)
    assert not supports(hooked, (x,), {})
    patched = nn.Sequential(nn.Linear(6, 3))  # a forward set on the instance replaces the class's
    patched[0].forward = lambda h: torch.zeros(h.shape[0], 3)
    assert not supports(patched, (x,), {})
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)  # global: runs in every call
    try:
        assert not supports(plain, (x,), {})
    finally:
        handle.remove()
    assert supports(plain, (x,), {})
    with pytest.raises(ValueError, match="at least one"):
        sequential_jvps(plain, x, {})


@pytest.mark.parametrize("name", ["cnn", "mlp"])
@pytest.mark.parametrize("loss", [LossType.CROSS_ENTROPY, LossType.MSE])
def test_gram_of_the_fast_path_equals_the_dual_number_path(name, loss, monkeypatch):
    model = _models()[name]
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    rec = InputRecorder()
    with rec.record(model):  # two recorded forwards (micro-batches), as a closure may run
        model(torch.randn(9, 64, dtype=torch.float64))
        model(torch.randn(5, 64, dtype=torch.float64))
    g = torch.Generator().manual_seed(2)
    dirs = [[torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params] for _ in range(2)]
    seen = []
    original = adaptive.sequential_jvp.sequential_jvps
    monkeypatch.setattr(adaptive.sequential_jvp, "sequential_jvps",
                        lambda *a: seen.append(1) or original(*a))
    fast = ggn_gram(model, rec.calls, names, params, dirs, loss, lambda o: o, identity_select=True)
    assert len(seen) == 2  # the fast path ran, once per recorded forward
    dual = ggn_gram(model, rec.calls, names, params, dirs, loss, lambda o: o)  # the default: dual numbers
    assert len(seen) == 2
    torch.testing.assert_close(fast, dual, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_adaptive_training_through_the_fast_path_equals_the_dual_number_path(name, monkeypatch):
    """12 adaptive K-FAC steps (LM damping every 2 steps, curvature every 5) in float64: the fast
    J·v path and the update applied with foreach calls give the parameters, coefficients and damping
    of the dual-number path (the products every earlier version used) to rounding."""
    from torchsso2.optim import SecondOrderOptimizer, sequential_jvp

    def run(fast: bool):
        if not fast:
            monkeypatch.setattr(sequential_jvp, "supports", lambda *a, **k: False)
        torch.manual_seed(0)
        model = _models()["mlp"] if name == "mlp" else nn.Sequential(  # K-FAC takes groups=1 convolutions
            nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(24, 3)).double()
        opt = SecondOrderOptimizer(model, approx="kfac", damping=0.01, adaptive_damping=True, seed=0,
                                   use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                                   curv_update_interval=5, inv_update_interval=5, damping_adaptation_interval=2)
        g = torch.Generator().manual_seed(4)
        coefs = []
        for _ in range(12):
            x = torch.randn(16, 64, generator=g, dtype=torch.float64)
            y = torch.randint(0, 3, (16,), generator=g)

            closure = make_closure(opt, model, x, y)
            opt.step(closure)
            coefs += [opt.adaptive.last["learning_rate"], opt.adaptive.last["momentum"], opt.damping]
        monkeypatch.undo()
        return [p.detach().clone() for p in model.parameters()], coefs

    fast_params, fast_coefs = run(True)
    dual_params, dual_coefs = run(False)
    for a, b in zip(fast_params, dual_params):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert fast_coefs == pytest.approx(dual_coefs, rel=1e-8)
    assert len(set(fast_coefs[2::3])) > 1  # the LM rule moved the damping


@pytest.mark.parametrize("moving", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("order", ["kn", "nk", "absent"])
def test_narrow_head_output_major_equals_the_row_major_products(moving, order):
    """A narrow last Linear (fewer than NARROW outputs, 2-d input) is computed output-major
    (``W hᵀ``, returned as transposed views): the same output and tangents as the row-major
    ``_linear`` (float64, to rounding), for every combination of weight / bias tangents and an
    incoming tangent stored in either memory order ([k, N, in] or [N, k, in]) or absent."""
    from torchsso2.optim import sequential_jvp as sj
    torch.manual_seed(4)
    lin = nn.Linear(7, 3).double()
    assert lin.out_features < sj.NARROW
    h = torch.randn(6, 7, dtype=torch.float64)
    k = 2
    tangents = {}
    if moving in ("both", "weight"):
        tangents[id(lin.weight)] = torch.randn(k, 3, 7, dtype=torch.float64)
    if moving in ("both", "bias"):
        tangents[id(lin.bias)] = torch.randn(k, 3, dtype=torch.float64)
    t = None
    if order == "kn":
        t = torch.randn(k, 6, 7, dtype=torch.float64)
    elif order == "nk":
        t = torch.randn(6, k, 7, dtype=torch.float64).transpose(0, 1)
    if t is None and not tangents:
        return  # nothing moves: the caller never gets here (sequential_jvps needs a tangent)
    out, nt = sj._linear_head(lin, h, t, tangents, k)
    ref_out, ref_nt = sj._linear(lin, h, t, tangents, k)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    assert nt.shape == ref_nt.shape == (k, 6, 3)
    torch.testing.assert_close(nt, ref_nt, rtol=1e-12, atol=1e-12)


def test_single_narrow_linear_jvps_equal_torch_func_jvp():
    """The head is also the first layer (no incoming tangent): output-major products against torch.func.jvp."""
    model = nn.Sequential(nn.Linear(5, 4)).double()
    x = torch.randn(8, 5, dtype=torch.float64)
    dirs = [{n: torch.randn(p.shape, dtype=torch.float64) for n, p in model.named_parameters()} for _ in range(2)]
    out, jv = sequential_jvps(model, x, {id(p): torch.stack([d[n] for d in dirs]) for n, p in model.named_parameters()})
    names = [n for n, _ in model.named_parameters()]
    f = lambda *ps: torch.func.functional_call(model, dict(zip(names, ps)), (x,))  # noqa: E731
    for i, d in enumerate(dirs):
        ref_out, ref_jv = torch.func.jvp(f, tuple(p.detach() for p in model.parameters()), tuple(d[n] for n in names))
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(jv[i], ref_jv, rtol=1e-10, atol=1e-12)
