"""Adaptive learning rate / momentum of SecondOrderOptimizer (torchsso2/optim/adaptive.py), against brute force.

On a linear model with the mse loss the loss is quadratic and its Hessian is the GGN, exactly;
with ``curvature="fisher"`` and ``ema_decay=0`` K-FAC and full blocks equal it and the diag block
is its diagonal. So the preconditioned direction ``Δ``, the previous update and the damped
quadratic model ``φ(α, μ) = L(θ + αΔ + μδ) + ½wd‖θ + …‖² + ½λ‖αΔ + μδ‖²`` can all be computed with
plain autograd in float64, and its minimiser compared with the step the optimizer took.
"""
from __future__ import annotations

import copy
import inspect
import math
import warnings

import pytest
import torch
from torch import nn

from curvature.likelihoods import sqrt_output_hessian
from curvature.options import LossType
from torchsso2.optim import SecondOrderOptimizer
from torchsso2.optim.adaptive import (InputRecorder, _flat_rows64, _foreach_scalar, _param_stacks, ggn_gram,
                                     hessian_gram, output_hessian_inner, solve_quadratic, within_objective)

from optim_helpers import flat, make_closure, nll, param_vec


def _unflatten(model: nn.Module, vec: torch.Tensor) -> dict:
    out, i = {}, 0
    for n, p in model.named_parameters():
        out[n] = vec[i:i + p.numel()].view_as(p)
        i += p.numel()
    return out


def _loss_at(model: nn.Module, vec: torch.Tensor, x: torch.Tensor, y: torch.Tensor, loss: str) -> torch.Tensor:
    return nll(loss, torch.func.functional_call(model, _unflatten(model, vec), (x,)), y)


def _linear_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    y = torch.randn(40, 3, generator=g, dtype=torch.float64)
    torch.manual_seed(seed)
    model = nn.Linear(5, 3).double()
    return model, x, y


@pytest.mark.parametrize("approx", ["kfac", "diag", "full"])
@pytest.mark.parametrize("mode", ["both", "lr", "momentum"])
def test_adaptive_step_is_the_exact_minimiser_of_the_damped_quadratic_model(approx, mode):
    model, x, y = _linear_problem()
    lam, wd = 0.05, 0.01
    opt = SecondOrderOptimizer(model, lr=0.3, momentum=0.4, weight_decay=wd, curvature="fisher", approx=approx,
                               loss="mse", damping=lam, ema_decay=0.0,
                               use_adaptive_learning_rate=mode in ("both", "lr"),
                               use_adaptive_momentum=mode in ("both", "momentum"),
                               kl_clip=None)  # momentum alone keeps the clip by default; here the plain model
    closure = make_closure(opt, model, x, y, "mse")
    f = lambda v: _loss_at(model, v, x, y, "mse")  # noqa: E731
    prev = None
    for step in range(3):
        theta = param_vec(model).clone()
        d = torch.autograd.functional.jacobian(f, theta) + wd * theta
        hess = torch.autograd.functional.hessian(f, theta)
        curv = hess if approx != "diag" else torch.diag(torch.diagonal(hess))
        delta = torch.linalg.solve(curv + lam * torch.eye(len(theta), dtype=torch.float64), d)

        def phi(w: torch.Tensor) -> torch.Tensor:
            v = w[0] * delta + (w[1] * prev if prev is not None else 0.0)
            t = theta + v
            return f(t) + 0.5 * wd * t.pow(2).sum() + 0.5 * lam * v.pow(2).sum()

        zero = torch.zeros(2, dtype=torch.float64)
        grad = torch.autograd.functional.jacobian(phi, zero)
        h2 = torch.autograd.functional.hessian(phi, zero)
        # the coefficients the optimizer may choose: lr/momentum fixed unless adapted; no momentum at the first step
        free = [mode in ("both", "lr"), prev is not None and mode in ("both", "momentum")]
        w = torch.tensor([-0.3, 0.4 if prev is not None else 0.0], dtype=torch.float64)
        idx = [i for i in range(2) if free[i]]
        fx = [i for i in range(2) if not free[i]]
        w[idx] = -torch.linalg.solve(h2[idx][:, idx], grad[idx] + h2[idx][:, fx] @ w[fx])
        opt.step(closure)
        new = param_vec(model)
        expected = theta + w[0] * delta + (w[1] * prev if prev is not None else 0.0)
        torch.testing.assert_close(new, expected, rtol=0, atol=1e-10)
        assert abs(opt.adaptive.last["learning_rate"] + float(w[0])) < 1e-10
        assert abs(opt.adaptive.last["momentum"] - float(w[1])) < 1e-10
        assert abs(opt.adaptive.last["quad_model"] - float(phi(w) - phi(zero))) < 1e-10
        prev = new - theta


def _mlp(seed: int = 0, act: type = nn.Tanh) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), act(), nn.Linear(6, 3)).double()


def _data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)


def _recorded_mlp(dirs_seed: int):
    """The MLP, its batch, parameters and names, its recorded forward and two random directions."""
    model, (x, y) = _mlp(), _data()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    rec = InputRecorder()
    with rec.record(model):
        model(x)
    g = torch.Generator().manual_seed(dirs_seed)
    dirs = [[torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params] for _ in range(2)]
    return model, x, y, params, names, rec, dirs


def test_ggn_gram_is_jt_h_j_of_brute_force():
    model, x, y, params, names, rec, dirs = _recorded_mlp(dirs_seed=3)
    gram = ggn_gram(model, rec.calls, names, params, dirs, LossType.CROSS_ENTROPY, lambda o: o)
    theta = param_vec(model)
    jac = torch.autograd.functional.jacobian(
        lambda v: torch.func.functional_call(model, _unflatten(model, v), (x,)), theta)  # [N, C, P]
    out = model(x).detach()
    sq = sqrt_output_hessian(LossType.CROSS_ENTROPY, out)  # [K, N, C]
    h = torch.einsum("knc,knd->ncd", sq, sq)
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, h, jac) / x.shape[0]
    vs = torch.stack([flat(d) for d in dirs])
    torch.testing.assert_close(gram, vs @ ggn @ vs.t(), rtol=1e-12, atol=1e-12)


def test_ggn_gram_reuses_the_dropout_mask_and_leaves_batchnorm_statistics_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 3)).double()
    x, _ = _data()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    rec = InputRecorder()
    with rec.record(model):
        model(x)
    stats = [b.clone() for b in model.buffers()]
    dirs = [[torch.randn_like(p) for p in params] for _ in range(2)]
    gram = ggn_gram(model, rec.calls, names, params, dirs, LossType.CROSS_ENTROPY, lambda o: o)
    for b, s in zip(model.buffers(), stats):
        assert torch.equal(b, s)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    torch.set_rng_state(rec.calls[0][2][0])  # the dropout mask of the recorded forward
    theta = param_vec(model)
    jac = torch.autograd.functional.jacobian(
        lambda v: torch.func.functional_call(model, {**_unflatten(model, v), **buffers}, (x,)), theta)
    torch.set_rng_state(rec.calls[0][2][0])
    out = torch.func.functional_call(model, {**dict(model.named_parameters()), **buffers}, (x,)).detach()
    sq = sqrt_output_hessian(LossType.CROSS_ENTROPY, out)
    h = torch.einsum("knc,knd->ncd", sq, sq)
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, h, jac) / x.shape[0]
    vs = torch.stack([flat(d) for d in dirs])
    torch.testing.assert_close(gram, vs @ ggn @ vs.t(), rtol=1e-12, atol=1e-12)


def test_param_stacks_and_flat_rows_equal_the_concatenated_vectors_bit_for_bit():
    """The per-parameter stacks of the directions and d, and the [k + 1, P] float64 rows built from
    them, against stacking each parameter and concatenating each vector's tensors (the former
    ``torch.cat([...]).double()``): the same numbers exactly, also for parameters of mixed dtypes and
    tensors that require grad (no history kept)."""
    g = torch.Generator().manual_seed(3)
    shapes = [(6, 4), (6,), (3, 6), (3,)]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float64]
    vecs = [[torch.randn(s, generator=g, dtype=dt) for s, dt in zip(shapes, dtypes)] for _ in range(3)]
    vecs[0][0].requires_grad_(True)
    stacks = _param_stacks(vecs)
    assert [tuple(t.shape) for t in stacks] == [(3, *s) for s in shapes]
    assert not any(t.requires_grad for t in stacks)
    for i, t in enumerate(stacks):
        for j in range(3):
            assert torch.equal(t[j], vecs[j][i].detach().to(t.dtype))
    flat = _flat_rows64(stacks)
    ref = torch.cat([t.detach().reshape(-1).double() for v in vecs for t in v]).view(3, -1)
    assert flat.dtype == torch.float64 and torch.equal(flat, ref)


def test_ggn_gram_of_given_stacked_directions_equals_stacking_them_itself():
    model, x, y, params, names, rec, dirs = _recorded_mlp(5)
    stacked = [torch.stack([d[i] for d in dirs]) for i in range(len(params))]
    for acts in (None, rec.activations):
        own = ggn_gram(model, rec.calls, names, params, dirs, LossType.CROSS_ENTROPY, lambda o: o,
                       identity_select=True, activations=acts)
        given = ggn_gram(model, rec.calls, names, params, dirs, LossType.CROSS_ENTROPY, lambda o: o,
                         identity_select=True, activations=acts, stacked=stacked)
        assert torch.equal(own, given)
    # directions in another dtype than the parameters are cast as the pass casts its own stacks
    low = [torch.stack([d[i].float() for d in dirs]) for i in range(len(params))]
    own = ggn_gram(model, rec.calls, names, params, [[t.float() for t in d] for d in dirs], LossType.CROSS_ENTROPY,
                   lambda o: o, identity_select=True)
    given = ggn_gram(model, rec.calls, names, params, dirs, LossType.CROSS_ENTROPY, lambda o: o,
                     identity_select=True, stacked=low)
    assert torch.equal(own, given)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_coefficients_equal_solving_the_tensor_quadratic_model(weight_decay):
    """coefficients() (a and b assembled in Python floats from one product of the stacked rows)
    against the model built from tensors: a = gram + λ·VVᵀ (+ the weight-decay inner products),
    b = V·d, solved by solve_quadratic."""
    model, (x, y) = _mlp(), _data()
    opt = SecondOrderOptimizer(model, approx="kfac", damping=0.03, weight_decay=weight_decay,
                               use_adaptive_learning_rate=True, use_adaptive_momentum=True)
    closure = make_closure(opt, model, x, y)
    opt.step(closure, targets=y)
    params = list(model.parameters())
    groups = [opt.param_groups[0]] * len(params)
    g = torch.Generator().manual_seed(11)
    deltas, prev, vecs = ([torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params] for _ in range(3))
    names = [n for n, _ in model.named_parameters()]
    with opt.adaptive.record(model):
        closure()
    calls = list(opt.adaptive.recorder.calls)
    w, value, base, fixed = opt.adaptive.coefficients(opt, params, groups, deltas, vecs, prev, y)
    assert base == 0.0 and fixed == [None, None]
    dirs = [deltas, prev]
    gram = ggn_gram(model, calls, names, params, dirs, LossType.CROSS_ENTROPY, lambda o: o)
    vmat = torch.stack([torch.cat([t.reshape(-1) for t in v]) for v in dirs]).double()
    dvec = torch.cat([t.reshape(-1) for t in vecs]).double()
    a = gram + opt.damping * (vmat @ vmat.t())
    if weight_decay:
        a = a + weight_decay * (vmat @ vmat.t())
    w_ref, value_ref = solve_quadratic(a, vmat @ dvec, [None, None])
    assert w == pytest.approx(w_ref, rel=1e-9, abs=1e-12)
    assert value == pytest.approx(value_ref, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_foreach_scalar_gives_the_products_of_the_python_float_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(s, generator=g).to(dtype) for s in [(6, 4), (6,), (3, 6), (3,)]]
    for value in (-0.3712345678901234, 1e-3 / 3, 12345.678901234567, -7.0):
        factor = _foreach_scalar(value, tensors)
        assert isinstance(factor, torch.Tensor) == (dtype in (torch.float32, torch.float64))
        for got, want in zip(torch._foreach_mul(tensors, factor), torch._foreach_mul(tensors, value)):
            assert got.dtype == dtype and torch.equal(got, want)
    mixed = [tensors[0].double(), tensors[1].float()]  # mixed dtypes: the Python float
    assert _foreach_scalar(0.5, mixed) == 0.5


def test_output_hessian_inner_matches_its_square_root():
    out = torch.randn(7, 4, dtype=torch.float64)
    u, w = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    for loss in (LossType.CROSS_ENTROPY, LossType.MSE):
        sq = sqrt_output_hessian(loss, out)
        expected = (torch.einsum("knc,nc->kn", sq, u) * torch.einsum("knc,nc->kn", sq, w)).sum()
        torch.testing.assert_close(output_hessian_inner(loss, out, u, w), expected)


@pytest.mark.parametrize("classes", [3, 10, 15, 16, 40])
@pytest.mark.parametrize("class_major", [False, True])
def test_output_hessian_root_factors_the_explicit_hessian(classes, class_major):
    """``r(u)ᵀ r(w) = uᵀ H_n w`` with ``H_n = diag(p_n) − p_n p_nᵀ`` built explicitly in float64, for logits
    stored row-major or class-major (as the fast J·v leaves them), with few classes (the softmax then runs
    over a leading dimension: adaptive.class_softmax) and many."""
    from torchsso2.optim.adaptive import class_softmax, output_hessian_root
    g = torch.Generator().manual_seed(classes)
    out = torch.randn(9, classes, generator=g, dtype=torch.float64) * 3
    if class_major:
        out = out.t().contiguous().t()  # the same values, stored [C, N]
    u = torch.randn(2, 9, classes, generator=g, dtype=torch.float64)
    p = torch.softmax(out.contiguous(), dim=1)
    torch.testing.assert_close(class_softmax(out, 1), p, rtol=1e-14, atol=0)
    torch.testing.assert_close(class_softmax(out.float(), 1), p.float(), rtol=1e-6, atol=1e-7)
    hess = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)  # [N, C, C]
    expected = torch.einsum("knc,ncd,jnd->kjn", u, hess, u)  # [2, 2, N]: u_kᵀ H_n u_j per example
    for r in (output_hessian_root(LossType.CROSS_ENTROPY, out.unsqueeze(0), u, class_dim=2),
              torch.stack([output_hessian_root(LossType.CROSS_ENTROPY, out, u[i]) for i in range(2)])):
        torch.testing.assert_close(torch.einsum("knc,jnc->kjn", r, r), expected, rtol=1e-12, atol=1e-14)


def test_the_gram_of_a_saturated_softmax_is_positive_semidefinite_in_float32():
    """A converged classifier (logits ~1e3 apart): the expanded ``Σ p u² − (pᵀu)²`` cancels to negative
    values in float32; the root's squares cannot, and the exact value (float64) is matched to rounding."""
    from torchsso2.optim.adaptive import output_hessian_root
    g = torch.Generator().manual_seed(0)
    out = torch.randn(200, 10, generator=g) * 3
    out[torch.arange(200), torch.randint(0, 10, (200,), generator=g)] += 25.0
    u = torch.randn(200, 10, generator=g) * 1e3
    p = torch.softmax(out, dim=1)
    expanded = (p * u * u).sum(1) - (p * u).sum(1) ** 2
    assert float(expanded.min()) < 0  # the cancellation this guards against
    inner = output_hessian_root(LossType.CROSS_ENTROPY, out, u).pow(2).sum(1)
    assert float(inner.min()) >= 0
    p64 = torch.softmax(out.double(), dim=1)
    u64 = u.double()
    exact = (p64 * (u64 - (p64 * u64).sum(1, keepdim=True)) ** 2).sum(1)
    torch.testing.assert_close(inner.double(), exact, rtol=1e-4, atol=1e-3)


def test_hessian_gram_is_the_hessian_of_brute_force():
    model, x, y, params, names, rec, dirs = _recorded_mlp(dirs_seed=4)
    gram = hessian_gram(model, rec.calls, names, params, dirs, LossType.CROSS_ENTROPY, lambda o: o, y)
    hess = torch.autograd.functional.hessian(lambda v: _loss_at(model, v, x, y, "cross_entropy"), param_vec(model))
    vs = torch.stack([flat(d) for d in dirs])
    torch.testing.assert_close(gram, vs @ hess @ vs.t(), rtol=1e-10, atol=1e-12)


def test_hessian_curvature_step_solves_the_hessian_model():
    model, (x, y) = _mlp(act=nn.Tanh), _data()
    lam = 0.5
    opt = SecondOrderOptimizer(model, curvature="hessian", approx="full", loss="cross_entropy", damping=lam,
                               ema_decay=0.0, use_adaptive_learning_rate=True, use_adaptive_momentum=True)
    closure = make_closure(opt, model, x, y)
    f = lambda v: _loss_at(model, v, x, y, "cross_entropy")  # noqa: E731
    opt.step(closure, targets=y)
    theta = param_vec(model).clone()
    hess = torch.autograd.functional.hessian(f, theta)
    d = torch.autograd.functional.jacobian(f, theta)
    # approx="full" is one block per layer: the block diagonal of the Hessian preconditions
    n0 = sum(p.numel() for p in model[0].parameters())
    blockdiag = torch.zeros_like(hess)
    blockdiag[:n0, :n0], blockdiag[n0:, n0:] = hess[:n0, :n0], hess[n0:, n0:]
    delta = torch.linalg.solve(blockdiag + lam * torch.eye(len(theta), dtype=torch.float64), d)
    prev = flat([opt.state[p]["adaptive_delta"] for p in model.parameters()])
    v = torch.stack([delta, prev], 1)
    a = v.t() @ (hess + lam * torch.eye(len(theta), dtype=torch.float64)) @ v
    w = -torch.linalg.solve(a, v.t() @ d)
    opt.step(closure, targets=y)
    torch.testing.assert_close(param_vec(model), theta + v @ w, rtol=0, atol=1e-10)


def test_lm_damping_is_fed_the_quadratic_model_value():
    model = _mlp(act=nn.ReLU)
    model = nn.Sequential(*model).float()
    x, y = _data()
    x = x.float()
    opt = SecondOrderOptimizer(model, curvature="fisher", approx="kfac", damping=1.0, adaptive_damping=True,
                               damping_adaptation_interval=1, damping_adaptation_decay=0.5,
                               use_adaptive_learning_rate=True, use_adaptive_momentum=True)
    closure = make_closure(opt, model, x, y)
    moves = set()
    for _ in range(12):
        with torch.no_grad():
            before, lam = float(nll("cross_entropy", model(x), y)), opt.damping
        opt.step(closure)
        with torch.no_grad():
            after = float(nll("cross_entropy", model(x), y))
        rho = (after - before) / opt.adaptive.last["quad_model"]
        expected = lam * 0.5 if rho > 0.75 else (lam / 0.5 if rho < 0.25 else lam)
        assert opt.lm.last_rho == pytest.approx(rho, rel=1e-4, abs=1e-6)
        assert opt.damping == pytest.approx(expected, rel=1e-12)
        moves.add((opt.damping > lam) - (opt.damping < lam))
    assert -1 in moves  # the rule did act (it shrinks the damping while the model predicts well)


def _train(opt, model, x, y, steps):
    closure = make_closure(opt, model, x, y)
    for _ in range(steps):
        opt.step(closure)


def test_checkpoint_of_the_adaptive_state_resumes_bit_exactly():
    x, y = _data()
    x = x.float()
    model = nn.Sequential(*_mlp()).float()
    kw = dict(curvature="fisher_mc", approx="kfac", damping=0.1, adaptive_damping=True, damping_adaptation_interval=2,
              use_adaptive_learning_rate=True, use_adaptive_momentum=True, seed=5)
    opt = SecondOrderOptimizer(model, **kw)
    _train(opt, model, x, y, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert "adaptive_delta" in next(iter(saved_opt["state"].values()))
    _train(opt, model, x, y, 4)
    clone = nn.Sequential(*_mlp(seed=9)).float()
    clone.load_state_dict(saved_model)
    other = SecondOrderOptimizer(clone, **kw)
    other.load_state_dict(saved_opt)
    assert other.adaptive.last == {k: v for k, v in saved_opt["torchsso2"]["extra"]["adaptive"].items()}
    _train(other, clone, x, y, 4)
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)
    assert other.damping == opt.damping and other.adaptive.last == opt.adaptive.last
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(opt.state[p]["adaptive_delta"], other.state[q]["adaptive_delta"])


def test_adaptive_trains_an_mlp_with_every_shape():
    x, y = _data()
    for approx, method in (("kfac", "eigen"), ("kfac", "inverse"), ("diag", "eigen"), ("full", "eigen")):
        model = nn.Sequential(*_mlp()).float()
        opt = SecondOrderOptimizer(model, approx=approx, kfac_method=method, damping=0.1, adaptive_damping=True,
                                   use_adaptive_learning_rate=True, use_adaptive_momentum=True)
        with torch.no_grad():
            first = float(nll("cross_entropy", model(x.float()), y))
        _train(opt, model, x.float(), y, 15)
        with torch.no_grad():
            last = float(nll("cross_entropy", model(x.float()), y))
        assert last < 0.5 * first, approx


def test_bad_inputs_raise_clear_errors():
    model = nn.Sequential(*_mlp()).float()
    with pytest.raises(TypeError, match="use_adaptive_learning_rate must be a bool"):
        SecondOrderOptimizer(model, use_adaptive_learning_rate="yes")
    with pytest.raises(TypeError, match="use_adaptive_momentum must be a bool"):
        SecondOrderOptimizer(model, use_adaptive_momentum=1)
    with pytest.raises(ValueError, match="kl_clip"):
        SecondOrderOptimizer(model, kl_clip=0.01, use_adaptive_learning_rate=True)
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not"):
        SecondOrderOptimizer(model, params=list(model.parameters()) + [stray], use_adaptive_learning_rate=True)
    x, y = _data()
    groups = [{"params": model[0].parameters(), "momentum": 0.9}, {"params": model[2].parameters(), "momentum": 0.5}]
    opt = SecondOrderOptimizer(model, params=groups, use_adaptive_learning_rate=True)
    closure = make_closure(opt, model, x.float(), y)
    opt.step(closure)  # the first step has no momentum direction
    with pytest.raises(ValueError, match="momentum.*one value"):
        opt.step(closure)
    silent = SecondOrderOptimizer(model, use_adaptive_learning_rate=True)
    silent.adaptive.recorder.calls = []
    p0 = list(model.parameters())
    with pytest.raises(RuntimeError, match="call the model"):
        silent.adaptive.coefficients(silent, p0, [silent.param_groups[0]] * len(p0), p0, p0, None, None)
    with pytest.raises(ValueError, match="targets"):
        hessian_gram(_mlp(), [], [], [], [], LossType.CROSS_ENTROPY, lambda o: o, None)
    with pytest.raises(ValueError, match="positive definite"):
        solve_quadratic(torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64), [None])


def test_solve_quadratic_fixed_and_free():
    a = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    b = torch.tensor([1.0, -1.0], dtype=torch.float64)
    w, val = solve_quadratic(a, b, [None, None])
    torch.testing.assert_close(torch.tensor(w, dtype=torch.float64), -torch.linalg.solve(a, b))
    wt = torch.tensor(w, dtype=torch.float64)
    assert abs(val - float(0.5 * wt @ a @ wt + b @ wt)) < 1e-15
    w, val = solve_quadratic(a, b, [None, 0.3])
    assert w[1] == 0.3 and abs(w[0] - (-(1.0 + 0.5 * 0.3) / 2.0)) < 1e-15
    w, val = solve_quadratic(a, b, [0.2, None])
    assert w[0] == 0.2 and abs(w[1] - (-(-1.0 + 0.5 * 0.2) / 1.0)) < 1e-15
    w, val = solve_quadratic(a[:1, :1], b[:1], [None])
    assert abs(w[0] + 0.5) < 1e-15 and abs(val + 0.25) < 1e-15
    with pytest.raises(ValueError, match="positive definite"):  # indefinite 2×2 (det < 0)
        solve_quadratic(torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64), b, [None, None])
    with pytest.raises(ValueError, match="1 or 2 coefficients"):
        solve_quadratic(torch.eye(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), [None] * 3)


def test_docs_adaptive_code_blocks_run(tmp_path, monkeypatch):
    from pathlib import Path

    from test_docs_code_blocks import python_blocks

    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(Path(__file__).resolve().parents[1] / "docs" / "adaptive.md")
    assert blocks
    namespace: dict = {"__name__": "docs_adaptive"}
    for line, code, _ in blocks:
        exec(compile(code, f"docs/adaptive.md:{line}", "exec"), namespace)
    assert namespace["opt"].adaptive.last["steps"] == 10


def test_benchmark_quick_grid_writes_its_table(tmp_path):
    import json

    from benchmarks import kfac_adaptive

    out = tmp_path / "a.json"
    report = kfac_adaptive.main(["--quick", "--no-timing", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert len(saved["grid"]) == 1 and saved["grid"][0]["damping"] == 0.01
    assert "seeds reaching" in report["grid_table"]
    run = saved["grid"][0]
    assert run["epochs"] is None or run["final_accuracy"] >= 0.97


def test_kl_clip_default_is_a_sentinel_off_in_adaptive_mode_and_an_explicit_value_is_refused():
    """The signature default of kl_clip is a sentinel: DEFAULT_KL_CLIP without an adaptive
    learning rate, off with one; any value the user passes (DEFAULT_KL_CLIP itself included)
    counts as explicit and is refused with an adaptive lr, kl_clip=None is accepted. With adaptive
    momentum alone the fixed lr sets the step: the clip stays (default and explicit)."""
    from torchsso2.optim.second_order import DEFAULT_KL_CLIP
    model = nn.Sequential(*_mlp()).float()
    assert SecondOrderOptimizer(model).kl_clip == DEFAULT_KL_CLIP
    assert SecondOrderOptimizer(model, kl_clip=DEFAULT_KL_CLIP).kl_clip == DEFAULT_KL_CLIP
    for flags in (dict(use_adaptive_learning_rate=True), dict(use_adaptive_learning_rate=True,
                                                            use_adaptive_momentum=True)):
        assert SecondOrderOptimizer(model, **flags).kl_clip is None
        assert SecondOrderOptimizer(model, kl_clip=None, **flags).kl_clip is None
        for explicit in (DEFAULT_KL_CLIP, 1e-3, 0.01):
            with pytest.raises(ValueError, match=f"kl_clip={explicit!r} cannot be combined"):
                SecondOrderOptimizer(model, kl_clip=explicit, **flags)
    assert SecondOrderOptimizer(model, use_adaptive_momentum=True).kl_clip == DEFAULT_KL_CLIP
    assert SecondOrderOptimizer(model, use_adaptive_momentum=True, kl_clip=0.01).kl_clip == 0.01


def test_adaptive_momentum_alone_clips_the_fixed_lr_step():
    """A fixed lr 0.1 on an exact-damping full block at damping 0.01: unclipped, the loss went 1.9,
    105, 5e8, 4e29 (the default clip had been switched off with adaptive momentum alone); clipped,
    its step along Δ has lr²·νΔᵀd = kl_clip, and training proceeds as in the plain mode."""
    losses = {}
    for clip in ("default", None):
        torch.manual_seed(964)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        x, y = torch.randn(12, 8), torch.randn(12, 4)
        kw = {} if clip == "default" else {"kl_clip": None}
        opt = SecondOrderOptimizer(model, lr=0.1, approx="full", damping=0.01, kfac_method="inverse", ema_decay=0.0,
                                   loss="mse", seed=0, use_adaptive_momentum=True, **kw)
        losses[clip] = [float(opt.step(make_closure(opt, model, x, y, loss="mse"), targets=y)[0]) for _ in range(4)]
    assert max(losses["default"]) <= losses["default"][0] * 1.5, losses
    assert not max(losses[None]) < 10 * losses[None][0], losses  # the same run without the clip blows up
    assert "default" in repr(inspect.signature(SecondOrderOptimizer).parameters["kl_clip"].default)


@pytest.mark.parametrize("adaptive", [False, True])
def test_lm_decay_is_per_step_so_one_adjustment_moves_by_decay_to_the_interval(adaptive):
    """kfac-jax's convention: ``damping_adaptation_decay`` is per step, an adjustment every
    ``interval`` steps multiplies or divides the damping by ``decay ** interval``, at exactly the
    steps where ``(step + 1) % interval == 0``; in between the damping does not move."""
    model = nn.Sequential(*_mlp(act=nn.ReLU)).float()
    x, y = _data()
    decay, interval = 0.9, 3
    kw = dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True) if adaptive else dict(kl_clip=None, lr=0.1)
    opt = SecondOrderOptimizer(model, curvature="fisher", approx="kfac", damping=1.0, adaptive_damping=True,
                               damping_adaptation_interval=interval, damping_adaptation_decay=decay, **kw)
    omega = decay ** interval
    closure = make_closure(opt, model, x.float(), y)
    moved = 0
    for step in range(12):
        lam = opt.damping
        opt.step(closure)
        if (step + 1) % interval:
            assert opt.damping == lam
            continue
        rho = opt.lm.last_rho
        expected = lam * omega if rho > 0.75 else (lam / omega if rho < 0.25 else lam)
        assert opt.damping == pytest.approx(expected, rel=1e-12), (step, rho)
        moved += opt.damping != lam
    assert moved >= 2


def test_within_objective_scales_the_step_to_a_predicted_decrease_of_at_most_the_objective():
    """``t = 1 − √(1 − objective/|M*|)`` puts ``M(t·w*) = −objective`` exactly (``w*`` the minimiser
    of ``M(w) = ½wᵀAw + bᵀw``); a model promising no more than the objective is left alone."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, generator=g, dtype=torch.float64)
    a, b = q @ q.t() + 0.1 * torch.eye(2, dtype=torch.float64), torch.randn(2, generator=g, dtype=torch.float64)
    w, value = solve_quadratic(a, b, [None, None])
    model = lambda c: float(0.5 * torch.tensor(c, dtype=torch.float64) @ a @ torch.tensor(c, dtype=torch.float64)
                            + b @ torch.tensor(c, dtype=torch.float64))
    assert value == pytest.approx(model(w), rel=1e-12) and value < 0
    for frac in (0.9, 0.5, 0.01):
        objective = -value * frac
        scaled, new = within_objective(w, value, objective)
        t = 1 - math.sqrt(1 - frac)
        assert scaled == pytest.approx([t * c for c in w], rel=1e-12)
        assert new == pytest.approx(-objective, rel=1e-12) and model(scaled) == pytest.approx(new, rel=1e-10)
    for objective in (-value, -value * 2, None):
        assert within_objective(w, value, objective) == (list(w), value)


def test_adaptive_step_never_promises_more_than_the_loss():
    """Digits MLP, pixels / 16, damping 1e-3: the first adaptive step's quadratic model (one-batch
    K-FAC direction, exact GGN) promises a decrease of 2.5 from a loss of 2.3; the step is scaled
    so the promise is the loss itself, and training no longer blows up."""
    from benchmarks.kfac_robustness import load_data
    data = load_data(standardize=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = SecondOrderOptimizer(model, approx="kfac", damping=1e-3, seed=0, use_adaptive_learning_rate=True,
                               use_adaptive_momentum=True, adaptive_damping=True)
    x, y = data["x_train"][:512], data["y_train"][:512]
    closure = make_closure(opt, model, x, y)
    losses = []
    for step in range(20):
        loss, _ = opt.step(closure)
        losses.append(float(loss.detach()))
        assert opt.adaptive.last["quad_model"] >= -losses[-1] * (1 + 1e-9), step
        if step == 0:
            assert opt.adaptive.last["quad_model"] == pytest.approx(-losses[0], rel=1e-9)  # the cap acted
    assert opt.num_skipped == 0 and max(losses) <= losses[0] * 2 and losses[-1] < 0.1 * losses[0]


def test_use_adaptive_damping_is_kfac_jax_name_for_adaptive_damping():
    """kfac-jax's three switches by their names: the same run as ``adaptive_damping=True``."""
    x, y = _data()
    runs = []
    for kw in ({"adaptive_damping": True}, {"use_adaptive_damping": True},
               {"adaptive_damping": True, "use_adaptive_damping": True}):
        model = _mlp()
        opt = SecondOrderOptimizer(model, damping=0.1, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                                   seed=3, **kw)
        assert opt.lm is not None
        _train(opt, model, x, y, 6)  # the LM rule acts at the 5th step
        runs.append((torch.cat([p.detach().flatten() for p in model.parameters()]), opt.damping))
    assert runs[0][1] != 0.1
    for vec, damping in runs[1:]:
        assert torch.equal(vec, runs[0][0]) and damping == runs[0][1]
    assert SecondOrderOptimizer(_mlp(), use_adaptive_damping=False).lm is None
    with pytest.raises(ValueError, match="contradict"):
        SecondOrderOptimizer(_mlp(), adaptive_damping=True, use_adaptive_damping=False)
    with pytest.raises(TypeError, match="use_adaptive_damping must be a bool"):
        SecondOrderOptimizer(_mlp(), use_adaptive_damping="yes")


@pytest.mark.parametrize("fixed", [[None, 0.9], [-0.05, None]])
def test_within_objective_keeps_a_fixed_coefficient_and_reports_the_model_there(fixed):
    """One coefficient adapted: only it is scaled (the group's momentum, or −lr, stays), and the value
    returned is the model's at the scaled point (an audit found μ = 0.9 scaled to 0.56 and M off by 16%)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, generator=g, dtype=torch.float64)
    a, b = q @ q.t() + 0.1 * torch.eye(2, dtype=torch.float64), 3 * torch.randn(2, generator=g, dtype=torch.float64)
    model = lambda c: float(0.5 * torch.tensor(c, dtype=torch.float64) @ a @ torch.tensor(c, dtype=torch.float64)
                            + b @ torch.tensor(c, dtype=torch.float64))
    w, value = solve_quadratic(a, b, fixed)
    base = model([0.0 if c is None else c for c in fixed])
    i = fixed.index(None)
    for objective in (-(value + base) / 2, max(0.0, -base) + 1e-3):  # between M(fixed part) and M(w), or beyond it
        if not value < -objective:
            continue
        scaled, new = within_objective(w, value, objective, fixed, base)
        assert scaled[1 - i] == fixed[1 - i]
        assert new == pytest.approx(model(scaled), rel=1e-10, abs=1e-12)
        if base + objective >= 0:
            assert new == pytest.approx(-objective, rel=1e-10)
        else:  # the fixed part alone promises more: the free coefficient goes to 0
            assert scaled[i] == 0.0 and new == pytest.approx(base, rel=1e-12)


def test_learning_rate_alone_keeps_the_groups_momentum_when_the_step_is_scaled():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(32, 5) * 4, torch.randint(0, 4, (32,))
    opt = SecondOrderOptimizer(model, momentum=0.9, damping=1e-6, use_adaptive_learning_rate=True, seed=0)
    scaled = 0
    for step in range(8):
        loss, _ = opt.step(make_closure(opt, model, x, y), targets=y)
        assert opt.adaptive.last["momentum"] == (0.9 if step else 0.0)  # the first step has no previous update
        scaled += step > 0 and opt.adaptive.last["quad_model"] == pytest.approx(-float(loss), rel=1e-9)
    assert scaled  # the rescaling acted at least once


def test_lm_ratio_counts_the_weight_decay_the_model_predicts():
    """Linear model, mse, weight decay 0.5: the quadratic model of loss + ½·wd·‖θ‖² is exact (up to
    the damping term), so ρ ≈ 1 at every step; the change of the loss alone gave 0.7, 1.1, 7 and −38."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 5, dtype=torch.float64), torch.randn(64, 3, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(5, 3)).double()
    opt = SecondOrderOptimizer(model, damping=1e-3, loss="mse", curvature="fisher", weight_decay=0.5,
                               adaptive_damping=True, damping_adaptation_interval=1, min_damping=1e-4,
                               use_adaptive_learning_rate=True, use_adaptive_momentum=True)
    for _ in range(4):
        opt.step(make_closure(opt, model, x, y, loss="mse"), targets=y)
        assert opt.lm.last_rho == pytest.approx(1.0, abs=0.01)


def test_the_objective_bound_counts_the_weight_decay():
    """A least-squares fit that is almost exact but has large weights, with weight decay 0.5: the
    damped quadratic model of the objective (loss + ½·wd·‖θ‖²) predicts a decrease far above the
    loss yet below the objective, so the step is the model's full minimiser, unscaled:
    θ + α*·Δ with Δ = (H + λI)⁻¹ d, d = g + wd·θ, α* = −Δᵀd / Δᵀ(H + λ + wd)Δ (float64, by hand)."""
    torch.manual_seed(0)
    n, wd, lam = 32, 0.5, 1e-3
    x = torch.randn(n, 3, dtype=torch.float64)
    w_true = torch.tensor([[5.0, -4.0, 3.0]], dtype=torch.float64)
    y = x @ w_true.t() + 2.0
    model = nn.Linear(3, 1).double()
    with torch.no_grad():
        model.weight.copy_(w_true + 1e-3)
        model.bias.fill_(2.0)
    theta0 = param_vec(model)
    xt = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)
    hess = xt.t() @ xt / n
    d = xt.t() @ (xt @ theta0 - y.reshape(-1)) / n + wd * theta0
    delta = torch.linalg.solve(hess + lam * torch.eye(4, dtype=torch.float64), d)
    curv = float(delta @ hess @ delta + (lam + wd) * delta @ delta)
    alpha = -float(delta @ d) / curv
    loss0 = float(nll("mse", model(x), y).detach())
    decrease = 0.5 * float(delta @ d) ** 2 / curv
    assert loss0 < decrease < loss0 + 0.5 * wd * float(theta0 @ theta0)  # the case the test is about
    opt = SecondOrderOptimizer(model, lr=0.1, curvature="hessian", approx="full", loss="mse", damping=lam,
                               weight_decay=wd, use_adaptive_learning_rate=True)
    opt.step(make_closure(opt, model, x, y, loss="mse"), targets=y)
    torch.testing.assert_close(param_vec(model), theta0 + alpha * delta, rtol=0, atol=1e-9)


def _adaptive(model):
    return SecondOrderOptimizer(model, damping=1e-2, adaptive_damping=True, use_adaptive_learning_rate=True,
                                use_adaptive_momentum=True)


@pytest.mark.parametrize("scale", [100.0, 300.0])
def test_a_float16_model_on_pixel_scale_inputs_trains_in_adaptive_mode(scale):
    """The quadratic model's J·v of a first step's preconditioned gradient (entries ~1e3) on inputs ~1e2
    overflowed float16 (and so did the Gram's sums of products): every step was skipped, and the run
    stalled, where the plain mode trained. Each direction is scaled to max |v| <= 1 by a power of two
    for the pass (J·v is linear in v) and the Gram is formed in float32, scaled back in float64."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(64, 16, generator=g) * scale).half(), torch.randint(0, 10, (64,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).half()
    opt = _adaptive(model)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        return loss
    first = float(closure())
    for _ in range(10):
        loss = opt.step(closure)
    assert opt.num_skipped == 0 and opt.num_steps == 10
    assert float(loss) < 0.5 * first


def test_the_scaled_gram_equals_the_unscaled_one_in_float64():
    """The power-of-two scaling is exact: with float64 it is not applied, and the scaled float16 Gram of
    small directions equals the float64 one to float16's resolution."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(8, 5, dtype=torch.float64)
    params = list(model.parameters())
    dirs = [[torch.randn_like(p) * 1e3 for p in params], [torch.randn_like(p) for p in params]]
    names = [n for n, _ in model.named_parameters()]
    want = ggn_gram(model, [((x,), {}, torch.get_rng_state())], names, params, dirs, LossType.CROSS_ENTROPY,
                    lambda o: o, identity_select=True)
    half = copy.deepcopy(model).half()
    got = ggn_gram(half, [((x.half(),), {}, torch.get_rng_state())], names, list(half.parameters()),
                   [[t.half() for t in d] for d in dirs], LossType.CROSS_ENTROPY, lambda o: o, identity_select=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3 * float(want.abs().max()))


def test_a_closure_without_backward_after_the_watched_calls_is_the_clear_error():
    """After the closure's first (watched) calls, a closure that forgot backward() reached the J·v pass
    with no tangent (an internal ValueError) after the curvature EMA had been updated; now the
    RuntimeError of the first calls, with the state as before the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    opt = _adaptive(model)

    def closure(backward=True):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if backward:
            loss.backward()
        return loss
    for _ in range(6):
        opt.step(closure)
    curvature = {n: [t.clone() for t in b.tensors()] for n, b in opt.running.blocks.items()}
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"the closure did not call backward\(\)"):
        opt.step(lambda: closure(backward=False))
    assert opt.num_steps == 6 and all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    for name, blk in opt.running.blocks.items():
        assert all(torch.equal(a, b) for a, b in zip(curvature[name], blk.tensors())), name
    opt.step(closure)
    assert opt.num_steps == 7


@pytest.mark.parametrize("with_targets", [False, True])  # a second closure call, or one forward (lm_forward.py)
def test_the_lm_rules_evaluation_leaves_the_running_statistics_as_one_forward(with_targets):
    """The loss after the update comes from another forward of the batch; BatchNorm's running statistics took
    the batch twice on every LM step before (the evaluation is not a training forward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    opt = SecondOrderOptimizer(model, adaptive_damping=True, damping_adaptation_interval=1, seed=0)
    closure = make_closure(opt, model, x, y)
    opt.step(closure, targets=y) if with_targets else opt.step(closure)
    assert opt.lm.last_rho == opt.lm.last_rho  # the rule ran (rho not NaN)
    with torch.no_grad():
        ref(x)  # one training forward of the batch
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model[1], name), getattr(ref[1], name), rtol=0, atol=0)


@pytest.mark.parametrize("flags, changes, named", [
    (dict(use_adaptive_learning_rate=True), dict(lr=0.05), "'lr'"),
    (dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True), dict(momentum=0.5), "'momentum'"),
    (dict(use_adaptive_momentum=True), dict(lr=0.05), None),  # the lr is used (α = −lr): no warning
])
def test_a_schedule_on_an_adapted_coefficient_warns_once(flags, changes, named) -> None:
    """A scheduler (or a hand-set value) on a coefficient the optimizer solves has no effect: the first step
    after the change says so, once; a change of a coefficient it uses does not warn."""
    model = _mlp()
    x, y = _data()
    opt = SecondOrderOptimizer(model, approx="kfac", damping=0.1, lr=0.1, momentum=0.9, **flags)
    closure = make_closure(opt, model, x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step(closure, targets=y)
        opt.param_groups[0].update(changes)
        for _ in range(3):
            opt.step(closure, targets=y)
    said = [str(w.message) for w in caught if "changed since the first step" in str(w.message)]
    if named is None:
        assert said == []
    else:
        assert len(said) == 1 and f"param groups' {named} changed" in said[0] and "no effect" in said[0]


def test_loading_a_checkpoint_is_not_a_schedule() -> None:
    """A checkpoint loaded after the first step brings its groups' values: not a change to warn about."""
    model = _mlp()
    x, y = _data()
    opt = SecondOrderOptimizer(model, approx="kfac", damping=0.1, lr=0.1, use_adaptive_learning_rate=True)
    closure = make_closure(opt, model, x, y)
    opt.step(closure, targets=y)
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = 0.05
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saved)
        opt.step(closure, targets=y)
        opt.step(closure, targets=y)
    assert not [w for w in caught if "changed since the first step" in str(w.message)]
