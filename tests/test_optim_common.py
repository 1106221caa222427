"""What SecondOrderOptimizer and VIOptimizer share with torch.optim: param groups, zero_grad,
LR schedulers, state_dict / load_state_dict, the non-finite policy and argument errors."""
from __future__ import annotations

import copy
import io
from typing import Any, Callable, Dict

import pytest
import torch
from torch import Tensor, nn

import torchsso2
from optim_helpers import (TinyMLP, batch, full_operator, grad_vec, make_closure, offsets, param_vec,
                           reference_curvature, tiny_mlp)
from torchsso2 import SecondOrderOptimizer, VIOptimizer

N_DATA = 100


def lr_vector(model: nn.Module, per_param: Dict[int, float]) -> Tensor:
    off = offsets(model)
    out = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    for p in model.parameters():
        out[off[id(p)]] = per_param[id(p)]
    return out


def so_direction(model, x, y, lam, wd_vec):
    c = reference_curvature(model, x, y, approx="kfac")
    op = full_operator(model, c.blocks, c.params, 1.0, lam, uncovered_diag=1.0)
    return torch.linalg.solve(op, grad_vec(model, x, y) + wd_vec * param_vec(model))


# ---- param groups, zero_grad, schedulers ---------------------------------------------------------------
def test_second_order_param_groups_per_group_lr_momentum_weight_decay():
    model = tiny_mlp()
    (x1, y1), (x2, y2) = batch(seed=1), batch(seed=2)
    lam = 1e-2
    fc1, fc2 = [model.fc1.weight, model.fc1.bias], [model.fc2.weight, model.fc2.bias]
    opt = SecondOrderOptimizer(model, kl_clip=None, lr=0.05, momentum=0.0, curvature="fisher", approx="kfac", damping=lam,
                               ema_decay=0.0, params=[dict(params=fc1, lr=0.1, momentum=0.5, weight_decay=0.1),
                                                      dict(params=fc2, lr=0.02)])
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.02]
    assert [g["momentum"] for g in opt.param_groups] == [0.5, 0.0]
    lr = lr_vector(model, {**{id(p): 0.1 for p in fc1}, **{id(p): 0.02 for p in fc2}})
    mom = lr_vector(model, {**{id(p): 0.5 for p in fc1}, **{id(p): 0.0 for p in fc2}})
    wd = lr_vector(model, {**{id(p): 0.1 for p in fc1}, **{id(p): 0.0 for p in fc2}})
    theta0 = param_vec(model)
    d1 = so_direction(model, x1, y1, lam, wd)
    opt.step(make_closure(opt, model, x1, y1))
    theta1 = param_vec(model)
    assert torch.allclose(theta1, theta0 - lr * d1, rtol=1e-9, atol=1e-12)
    d2 = so_direction(model, x2, y2, lam, wd)
    opt.step(make_closure(opt, model, x2, y2))
    assert torch.allclose(param_vec(model), theta1 - lr * (mom * d1 + d2), rtol=1e-9, atol=1e-12)
    assert all("momentum_buffer" in opt.state[p] for p in fc1)
    assert all("momentum_buffer" not in opt.state[p] for p in fc2)


def test_vi_param_groups_per_group_lr():
    model, (x, y) = tiny_mlp(), batch()
    delta = 2.0
    fc1, fc2 = [model.fc1.weight, model.fc1.bias], [model.fc2.weight, model.fc2.bias]
    opt = VIOptimizer(model, dataset_size=N_DATA, lr=0.01, curvature_init=None, curvature="fisher", approx="kfac", prior_precision=delta,
                      params=[dict(params=fc1, lr=0.05), dict(params=fc2, momentum=0.0)])
    lr = lr_vector(model, {**{id(p): 0.05 for p in fc1}, **{id(p): 0.01 for p in fc2}})
    c = reference_curvature(model, x, y, approx="kfac")
    op = full_operator(model, c.blocks, c.params, N_DATA, delta, uncovered_diag=N_DATA)
    mu0 = param_vec(model)
    step = torch.linalg.solve(op, N_DATA * grad_vec(model, x, y) + delta * mu0)
    closure = make_closure(opt, model, x, y)
    opt.step(closure)
    assert torch.allclose(param_vec(model), mu0 - lr * step, rtol=1e-9, atol=1e-12)
    opt.step(closure)
    assert all("momentum_buffer" in opt.state[p] for p in fc1)
    assert all("momentum_buffer" not in opt.state[p] for p in fc2)


def _so(model, **kw):
    return SecondOrderOptimizer(model, **{"lr": 0.05, "curvature": "fisher_mc", "seed": 0, **kw})


def _vi(model, **kw):
    return VIOptimizer(model, **{"dataset_size": N_DATA, "lr": 0.01, "curvature": "fisher_mc", "seed": 0, **kw})


@pytest.mark.parametrize("make", [_so, _vi], ids=["second_order", "vi"])
def test_zero_grad(make):
    model, (x, y) = tiny_mlp(), batch()
    opt = make(model)
    opt.step(make_closure(opt, model, x, y))
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_step_lr_scheduler_changes_the_effective_step():
    model = tiny_mlp()
    (x1, y1), (x2, y2) = batch(seed=1), batch(seed=2)
    lr, lam, gamma = 0.2, 1e-2, 0.1
    opt = SecondOrderOptimizer(model, kl_clip=None, lr=lr, momentum=0.0, curvature="fisher", approx="kfac", damping=lam,
                               ema_decay=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
    zero = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    theta0 = param_vec(model)
    d1 = so_direction(model, x1, y1, lam, zero)
    opt.step(make_closure(opt, model, x1, y1))
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(lr * gamma)
    theta1 = param_vec(model)
    assert torch.allclose(theta1, theta0 - lr * d1, rtol=1e-9, atol=1e-12)
    d2 = so_direction(model, x2, y2, lam, zero)
    opt.step(make_closure(opt, model, x2, y2))
    assert torch.allclose(param_vec(model), theta1 - lr * gamma * d2, rtol=1e-9, atol=1e-12)


def test_vi_lr_scheduler_to_zero_freezes_the_mean_but_not_the_curvature():
    model, (x, y) = tiny_mlp(), batch()
    opt = _vi(model, approx="diag", ema_decay=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch == 0 else 0.0)
    closure = make_closure(opt, model, x, y)
    mu0 = param_vec(model)
    opt.step(closure)
    sched.step()
    mu1 = param_vec(model)
    assert not torch.equal(mu0, mu1)
    prec1 = opt.posterior_precision()
    opt.step(closure)
    assert torch.equal(param_vec(model), mu1)
    assert not torch.equal(opt.posterior_precision(), prec1)


# ---- state_dict / load_state_dict ------------------------------------------------------------------------
def _flatten_state(obj: Any, prefix: str = "") -> Dict[str, Any]:
    """Nested dicts/lists -> ``{path: leaf}``."""
    out: Dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten_state(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flatten_state(v, f"{prefix}/{i}"))
    else:
        out[prefix] = obj
    return out


def assert_same_state(a: Dict[str, Any], b: Dict[str, Any], ignore=()) -> None:
    fa, fb = _flatten_state(a), _flatten_state(b)
    fa = {k: v for k, v in fa.items() if not any(s in k for s in ignore)}
    fb = {k: v for k, v in fb.items() if not any(s in k for s in ignore)}
    assert fa.keys() == fb.keys(), set(fa) ^ set(fb)
    for k in fa:
        va, vb = fa[k], fb[k]
        if isinstance(va, Tensor):
            assert isinstance(vb, Tensor) and va.dtype == vb.dtype and torch.equal(va, vb), k
        elif isinstance(va, float) and va != va:
            assert vb != vb, k
        else:
            assert va == vb, (k, va, vb)


RESUME_CASES = [
    ("second_order", "kfac"), ("second_order", "diag"), ("second_order", "full"),
    ("vi", "diag"), ("vi", "kfac"), ("vi", "full"),
]


def _resume_opt(face: str, approx: str, model: nn.Module, seed: int):
    common = dict(curvature="fisher_mc", approx=approx, ema_decay=0.9, momentum=0.9, curv_update_interval=2,
                  inv_update_interval=3, seed=seed)
    if face == "second_order":
        return SecondOrderOptimizer(model, lr=0.05, weight_decay=1e-3, damping=0.05, adaptive_damping=True,
                                    damping_adaptation_interval=2, **common)
    return VIOptimizer(model, dataset_size=N_DATA, lr=0.01, prior_precision=1.0, init_precision=50.0, **common)


@pytest.mark.parametrize("face,approx", RESUME_CASES)
def test_state_dict_resume_is_bit_identical(face, approx):
    """K1 steps, checkpoint through torch.save/torch.load, K2 more steps in a fresh model + optimizer
    (different init and seed) == K1 + K2 uninterrupted steps, bit for bit: params, momentum, curvature
    EMA and decompositions, counters, the sampling generator (labels for fisher_mc, weights for VI)."""
    # k1 = 5: the first resumed step (index 5) neither estimates (5 % 2) nor decomposes (5 % 3), so it
    # runs on the loaded curvature EMA and decomposition (and, for VI, samples from the loaded posterior)
    k1, k2 = 5, 4
    batches = [batch(n=10, seed=i) for i in range(k1 + k2)]

    def run(model, opt, todo):
        for x, y in todo:
            opt.step(make_closure(opt, model, x, y))

    model_a = tiny_mlp(seed=0)
    opt_a = _resume_opt(face, approx, model_a, seed=5)
    run(model_a, opt_a, batches)

    model_b = tiny_mlp(seed=0)
    opt_b = _resume_opt(face, approx, model_b, seed=5)
    run(model_b, opt_b, batches[:k1])
    buf = io.BytesIO()
    torch.save({"model": model_b.state_dict(), "opt": opt_b.state_dict()}, buf)
    del model_b, opt_b

    def restored(reseed: bool = False):
        buf.seek(0)
        ck = torch.load(buf)
        model_c = tiny_mlp(seed=99)
        opt_c = _resume_opt(face, approx, model_c, seed=77)
        model_c.load_state_dict(ck["model"])
        opt_c.load_state_dict(ck["opt"])
        if reseed:
            opt_c.generator.manual_seed(12345)
        return model_c, opt_c

    model_c, opt_c = restored()
    assert opt_c.num_steps == k1
    run(model_c, opt_c, batches[k1:])
    assert torch.equal(param_vec(model_c), param_vec(model_a))
    assert_same_state(opt_c.state_dict(), opt_a.state_dict())
    if face == "vi":
        x = batches[0][0]
        assert torch.equal(opt_c.predict(x, num_samples=3), opt_a.predict(x, num_samples=3))
    else:
        assert opt_c.damping == opt_a.damping and opt_c.lm.last_rho == opt_a.lm.last_rho
    # control: the generator state is part of what makes the run identical
    model_d, opt_d = restored(reseed=True)
    run(model_d, opt_d, batches[k1:])
    assert not torch.equal(param_vec(model_d), param_vec(model_a))


class OtherNames(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("face", ["second_order", "vi"])
@pytest.mark.parametrize("other", ["names", "width", "approx"])
def test_loading_a_checkpoint_of_another_model_raises(face, other):
    model, (x, y) = tiny_mlp(), batch()
    opt = _resume_opt(face, "kfac", model, seed=0)
    for _ in range(2):
        opt.step(make_closure(opt, model, x, y))
    ck = copy.deepcopy(opt.state_dict())
    if other == "names":
        target = OtherNames().double()
    elif other == "width":
        torch.manual_seed(1)
        target = TinyMLP(hidden=6).double()
    else:
        target = tiny_mlp(seed=1)
    approx = "diag" if other == "approx" else "kfac"
    target_opt = _resume_opt(face, approx, target, seed=1)
    target_opt.step(make_closure(target_opt, target, x, y))
    before = copy.deepcopy(target_opt.state_dict())
    with pytest.raises(ValueError):
        target_opt.load_state_dict(ck)
    # a refused checkpoint leaves the optimizer as it was
    assert_same_state(target_opt.state_dict(), before)


# ---- non-finite policy ---------------------------------------------------------------------------------
def _nan_grad(model: nn.Module) -> Callable[[], None]:
    def inject() -> None:
        model.fc1.weight.grad[0, 0] = float("nan")
    return inject


@pytest.mark.parametrize("face", ["second_order", "vi"])
@pytest.mark.parametrize("where", ["gradient", "input"])
@pytest.mark.parametrize("warm", [3, 5])
def test_nonfinite_step_is_skipped_and_changes_nothing(face, where, warm):
    """Curvature every 2 steps, decompositions every 3: the bad step (index ``warm``) decomposes
    (3) or neither estimates nor decomposes (5; SecondOrderOptimizer then leaves the gradient to
    the finite check of the preconditioned update)."""
    model, (x, y) = tiny_mlp(), batch()
    opt = _resume_opt(face, "kfac", model, seed=0)
    for s in range(warm):
        xb, yb = batch(seed=s)
        opt.step(make_closure(opt, model, xb, yb))
    before_state = copy.deepcopy(opt.state_dict())
    before_params = param_vec(model)
    if where == "gradient":
        bad = make_closure(opt, model, x, y, after_backward=_nan_grad(model))
    else:
        x_bad = x.clone()
        x_bad[2, 1] = float("nan")
        bad = make_closure(opt, model, x_bad, y)
    opt.step(bad)
    assert opt.num_skipped == 1
    assert torch.equal(param_vec(model), before_params)
    # everything but the counters and the sampling generator (which drew this step's labels/weights)
    assert_same_state(opt.state_dict(), before_state, ignore=("num_skipped", "consecutive_skips"))
    opt.step(make_closure(opt, model, x, y))  # a finite step afterwards is taken as usual
    assert opt.num_skipped == 1 and torch.isfinite(param_vec(model)).all()
    assert not torch.equal(param_vec(model), before_params)


@pytest.mark.parametrize("face", ["second_order", "vi"])
def test_nonfinite_raise(face):
    model, (x, y) = tiny_mlp(), batch()
    opt = _resume_opt(face, "kfac", model, seed=0)
    opt.on_nonfinite = "raise"
    opt.step(make_closure(opt, model, x, y))
    before_state = copy.deepcopy(opt.state_dict())
    before_params = param_vec(model)
    with pytest.raises(torchsso2.NonFiniteError):
        opt.step(make_closure(opt, model, x, y, after_backward=_nan_grad(model)))
    assert torch.equal(param_vec(model), before_params)
    assert_same_state(opt.state_dict(), before_state, ignore=())
    with pytest.raises(ValueError, match="on_nonfinite='ignore'"):
        SecondOrderOptimizer(tiny_mlp(), on_nonfinite="ignore")
    assert issubclass(torchsso2.NonFiniteError, FloatingPointError)


# ---- argument errors -------------------------------------------------------------------------------------
SO_ERRORS = [
    (dict(lr=-0.1), ValueError, "lr=-0.1"),
    (dict(damping=-1e-3), ValueError, "damping=-0.001"),
    (dict(curv_update_interval=0), ValueError, "curv_update_interval=0"),
    (dict(inv_update_interval=0), ValueError, "inv_update_interval=0"),
    (dict(curv_update_interval=1.5), TypeError, "curv_update_interval"),
    (dict(ema_decay=1.0), ValueError, "ema_decay=1.0"),
    (dict(ema_decay=-0.1), ValueError, "ema_decay=-0.1"),
    (dict(momentum=1.5), ValueError, "momentum=1.5"),
    (dict(weight_decay=-1.0), ValueError, "weight_decay=-1.0"),
    (dict(kl_clip=0.0), ValueError, "kl_clip=0.0"),
    (dict(curvature="foo"), ValueError, "'foo'"),
    (dict(approx="bar"), ValueError, "'bar'"),
    (dict(loss="hinge"), ValueError, "'hinge'"),
    (dict(lr="0.1"), TypeError, "lr"),
    (dict(adaptive_damping=True, damping=0.0), ValueError, "damping"),
]
VI_ERRORS = [
    (dict(dataset_size=0), ValueError, "dataset_size=0"),
    (dict(dataset_size=10.5), TypeError, "dataset_size"),
    (dict(prior_precision=-1.0), ValueError, "prior_precision=-1.0"),
    (dict(prior_precision=1.0, prior_variance=1.0), ValueError, "prior_precision=1.0, prior_variance=1.0"),
    (dict(prior_variance=0.0), ValueError, "prior_variance=0.0"),
    (dict(prior_precision=0.0), ValueError, "prior_precision"),
    (dict(num_mc_samples=0), ValueError, "num_mc_samples=0"),
    (dict(lr=-1.0), ValueError, "lr=-1.0"),
    (dict(ema_decay=1.0), ValueError, "ema_decay=1.0"),
    (dict(kl_weighting=-1.0), ValueError, "kl_weighting=-1.0"),
    (dict(curvature="foo"), ValueError, "'foo'"),
    (dict(approx="bar"), ValueError, "'bar'"),
]


@pytest.mark.parametrize("kwargs,exc,match", SO_ERRORS, ids=[str(e[0]) for e in SO_ERRORS])
def test_second_order_argument_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match.replace("(", r"\(").replace(".", r"\.")):
        SecondOrderOptimizer(tiny_mlp(), **kwargs)


@pytest.mark.parametrize("kwargs,exc,match", VI_ERRORS, ids=[str(e[0]) for e in VI_ERRORS])
def test_vi_argument_errors(kwargs, exc, match):
    kw = {"dataset_size": N_DATA, **kwargs}
    with pytest.raises(exc, match=match.replace(".", r"\.")):
        VIOptimizer(tiny_mlp(), **kw)


@pytest.mark.parametrize("make", [_so, _vi], ids=["second_order", "vi"])
def test_closure_returns_the_loss_or_loss_and_output(make):
    """(More in tests/test_loss_only_closure.py.)"""
    model, (x, y) = tiny_mlp(), batch()
    opt = make(model)
    before = param_vec(model)

    def no_loss():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(TypeError, match=r"must return the loss .*, or \(loss, output\)"):
        opt.step(no_loss)
    with pytest.raises(TypeError, match="closure"):
        opt.step()
    assert torch.equal(param_vec(model), before)
    with pytest.raises(TypeError, match="nn.Module"):
        type(opt)([p for p in model.parameters()], **({"dataset_size": 10} if make is _vi else {}))


@pytest.mark.parametrize("bad_call", [0, 1])
def test_vi_nonfinite_in_one_of_several_mc_samples_skips_the_step(bad_call):
    """num_mc_samples=2: a non-finite output in either sample skips the whole step."""
    model, (x, y) = tiny_mlp(), batch()
    opt = _vi(model, approx="kfac", num_mc_samples=2, init_precision=50.0)
    opt.step(make_closure(opt, model, x, y))
    before_state = copy.deepcopy(opt.state_dict())
    before_params = param_vec(model)
    x_bad = x.clone()
    x_bad[0, 0] = float("nan")
    closures = [make_closure(opt, model, x, y), make_closure(opt, model, x_bad, y)]
    if bad_call == 0:
        closures.reverse()
    calls = []

    def closure():
        calls.append(1)
        return closures[len(calls) - 1]()
    opt.step(closure)
    assert len(calls) == 2 and opt.num_skipped == 1
    assert torch.equal(param_vec(model), before_params)
    assert_same_state(opt.state_dict(), before_state, ignore=("num_skipped", "consecutive_skips"))
