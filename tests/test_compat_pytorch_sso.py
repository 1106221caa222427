"""torchsso2.compat.pytorch_sso: PyTorch-SSO's signature and config, its update formulas written
out by hand in float64 (from torchsso/optim/secondorder.py, vi.py and torchsso/curv/*), and the
options without an equivalent."""
from __future__ import annotations

import logging
import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchsso2
from torchsso2.compat.pytorch_sso import SecondOrderOptimizer, VIOptimizer, from_config
from optim_helpers import make_closure


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _batches(k: int = 2, n: int = 6):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, dtype=torch.float64, generator=gen), torch.randint(0, 2, (n,), generator=gen))
            for _ in range(k)]


def _forward_by_hand(ws, x, y):
    """Per-layer inputs with a ones column ``[N, d+1]``, per-example output gradients ``e`` of
    ``ℓ_n`` (``[N, d_out]``), and the mean-loss gradients ``[W | b]`` per layer."""
    (w1, b1), (w2, b2) = ws
    h = torch.tanh(x @ w1.t() + b1)
    z2 = h @ w2.t() + b2
    e2 = torch.softmax(z2, 1) - F.one_hot(y, 2).double()
    e1 = (e2 @ w2) * (1 - h ** 2)
    ones = torch.ones(len(x), 1, dtype=torch.float64)
    ins = [torch.cat([x, ones], 1), torch.cat([h, ones], 1)]
    outs = [e1, e2]
    grads = [e.t() @ a / len(x) for e, a in zip(outs, ins)]  # [d_out, d_in + 1] = [gW | gb]
    return ins, outs, grads


def _params(model):
    return [(model[0].weight.detach().clone(), model[0].bias.detach().clone()),
            (model[2].weight.detach().clone(), model[2].bias.detach().clone())]


def test_kfac_two_steps_equal_pytorch_sso_formula() -> None:
    """curv_type='Cov' (empirical Fisher), Kron on Linear; damping split √λ·π / √λ/π (pi_type
    tracenorm, λ = damping + l2_reg), ema_decay = weight of the new batch, l2_reg coupled (gradient
    and damping), weight_decay decoupled after the solve and inside the preconditioned momentum."""
    damping, beta, lr, mom, l2, wd = 0.01, 0.3, 0.1, 0.5, 1e-3, 1e-2
    model = _mlp()
    ws = [torch.cat([w, b[:, None]], 1) for w, b in _params(model)]
    opt = SecondOrderOptimizer(model, "Cov", {"Linear": "Kron"}, {"damping": damping, "ema_decay": beta},
                               lr=lr, momentum=mom, l2_reg=l2, weight_decay=wd)
    ema, bufs = None, [None, None]
    lam = damping + l2
    for x, y in _batches():
        ins, outs, grads = _forward_by_hand([(w[:, :-1], w[:, -1]) for w in ws], x, y)
        data = [(a.t() @ a / len(x), e.t() @ e / len(x)) for a, e in zip(ins, outs)]
        ema = data if ema is None else [(beta * a + (1 - beta) * ea, beta * g + (1 - beta) * eg)
                                        for (a, g), (ea, eg) in zip(data, ema)]
        for i, ((a, g), grad) in enumerate(zip(ema, grads)):
            pi = math.sqrt((a.trace() / a.shape[0]) / (g.trace() / g.shape[0]))
            a_inv = torch.linalg.inv(a + math.sqrt(lam) * pi * torch.eye(a.shape[0], dtype=torch.float64))
            g_inv = torch.linalg.inv(g + math.sqrt(lam) / pi * torch.eye(g.shape[0], dtype=torch.float64))
            delta = g_inv @ (grad + l2 * ws[i]) @ a_inv + wd * ws[i]
            bufs[i] = delta if bufs[i] is None else mom * bufs[i] + delta
            ws[i] = ws[i] - lr * bufs[i]
        opt.step(make_closure(opt, model, x, y))
        got = [torch.cat([model[j].weight, model[j].bias[:, None]], 1).detach() for j in (0, 2)]
        for g_, w_ in zip(got, ws):
            torch.testing.assert_close(g_, w_, rtol=1e-9, atol=1e-12)


def test_vogn_step_equals_pytorch_sso_formula() -> None:
    """VIOptimizer, curv_type='Cov', Diag (VOGN): per-example damping, l2 = kl/(N σ²), a raw gradient
    EMA (grad_ema_decay d), decoupled weight decay; no init_precision, so the first step draws no
    noise (as in PyTorch-SSO) and is deterministic."""
    n_data, damping, kl, var, d, lr, wd = 100, 1e-3, 0.5, 2.0, 0.1, 0.05, 1e-2
    model = _mlp()
    (x, y), = _batches(1)
    ws = [torch.cat([w, b[:, None]], 1) for w, b in _params(model)]
    opt = VIOptimizer(model, n_data, "Cov", {"Linear": "Diag"}, {"damping": damping, "ema_decay": 0.01},
                      lr=lr, grad_ema_decay=d, weight_decay=wd, num_mc_samples=1, kl_weighting=kl,
                      prior_variance=var)
    ins, outs, grads = _forward_by_hand([(w[:, :-1], w[:, -1]) for w in ws], x, y)
    l2 = kl / n_data / var
    expected = []
    for a, e, grad, w in zip(ins, outs, grads, ws):
        fisher = torch.einsum("ni,nj->ij", e ** 2, a ** 2) / len(x)  # mean of squared per-example grads
        ema_grad = d * (grad + l2 * w)                            # (1-d)·0 + d·g, raw
        expected.append(w - lr * (ema_grad / (fisher + damping + l2) + wd * w))
    opt.step(make_closure(opt, model, x, y))
    got = [torch.cat([model[j].weight, model[j].bias[:, None]], 1).detach() for j in (0, 2)]
    for g_, w_ in zip(got, expected):
        torch.testing.assert_close(g_, w_, rtol=1e-9, atol=1e-12)


def test_noisy_kfac_step_equals_pytorch_sso_formula() -> None:
    """VIOptimizer, Kron: the mean's step solves with N·(A + √λ'π)⊗(G + √λ'/π), λ' = damping + l2
    per example (PyTorch-SSO's KronCurvature with l2 = kl/(Nσ²) in its damping), of g + l2·μ;
    momentum 0, so the first step (no init_precision: no noise) is deterministic."""
    n_data, damping, kl, var, lr = 200, 1e-2, 0.5, 2.0, 0.1
    model = _mlp()
    (x, y), = _batches(1)
    ws = [torch.cat([w, b[:, None]], 1) for w, b in _params(model)]
    opt = VIOptimizer(model, n_data, "Cov", {"Linear": "Kron"}, {"damping": damping, "ema_decay": 0.5},
                      lr=lr, num_mc_samples=1, kl_weighting=kl, prior_variance=var)
    ins, outs, grads = _forward_by_hand([(w[:, :-1], w[:, -1]) for w in ws], x, y)
    l2 = kl / n_data / var
    lam = damping + l2
    expected = []
    for a_in, e, grad, w in zip(ins, outs, grads, ws):
        a, g = a_in.t() @ a_in / len(x), e.t() @ e / len(x)
        pi = math.sqrt((a.trace() / a.shape[0]) / (g.trace() / g.shape[0]))
        a_inv = torch.linalg.inv(a + math.sqrt(lam) * pi * torch.eye(a.shape[0], dtype=torch.float64))
        g_inv = torch.linalg.inv(g + math.sqrt(lam) / pi * torch.eye(g.shape[0], dtype=torch.float64))
        expected.append(w - lr * g_inv @ (grad + l2 * w) @ a_inv)
    opt.step(make_closure(opt, model, x, y))
    got = [torch.cat([model[j].weight, model[j].bias[:, None]], 1).detach() for j in (0, 2)]
    for g_, w_ in zip(got, expected):
        torch.testing.assert_close(g_, w_, rtol=1e-9, atol=1e-12)
    # the decomposition kept for the next step (solves and weight noise) is N·(G' ⊗ A') of the EMA
    blk = opt.running.blocks["2"]
    assert blk.decomposition["method"] == "eigen"
    z = torch.randn(blk.layout.numel, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sol = blk.solve(blk.layout.unflatten(z.clone()))
    a_ema, g_ema = blk.A, blk.G
    pi = math.sqrt((a_ema.trace() / a_ema.shape[0]) / (g_ema.trace() / g_ema.shape[0]))
    ap = a_ema + math.sqrt(lam) * pi * torch.eye(a_ema.shape[0], dtype=torch.float64)
    gp = g_ema + math.sqrt(lam) / pi * torch.eye(g_ema.shape[0], dtype=torch.float64)
    zm = torch.cat([z[:blk.layout.numel - g_ema.shape[0]].reshape(g_ema.shape[0], -1), z[-g_ema.shape[0]:, None]], 1)
    want = torch.linalg.inv(gp) @ zm @ torch.linalg.inv(ap) / n_data
    torch.testing.assert_close(torch.cat([sol[0], sol[1][:, None]], 1), want, rtol=1e-9, atol=1e-12)


def test_vi_init_precision_is_the_per_example_curvature_start() -> None:
    """PyTorch-SSO's posterior covariance is (kl/N)·(C + λ + l2_ema)⁻¹ with C starting at init_precision·I
    and l2_ema, its prior term l2 = kl/(Nσ²) in the damping, starting at 0 (element_wise_init and the first
    curv.step() run before l2 is set) and EMA'd with the curvature's weight β: precision (N/kl)(init + λ)
    before the first batch, (N/kl)(C_t + λ) + (1/σ²)(1 − (1−β)^t) after t batches."""
    n_data, damping, kl, var, init, beta = 50, 1e-3, 0.5, 2.0, 8e-3, 0.3
    model = _mlp()
    opt = VIOptimizer(model, n_data, "Cov", {"Linear": "Diag"}, {"damping": damping, "ema_decay": beta},
                      kl_weighting=kl, prior_variance=var, init_precision=init)
    prec = opt.posterior_precision()
    expected = n_data / kl * (init + damping)
    torch.testing.assert_close(prec.diagonal(), torch.full((prec.shape[0],), expected, dtype=prec.dtype))
    assert opt.running.num_updates == 1  # the first batch is folded in with weight β, not copied
    for t, (x, y) in enumerate(_batches(3), start=1):
        opt.step(make_closure(opt, model, x, y))
        running = torch.cat([opt.running.blocks[n].diagonal for n in ("0", "2")])
        want = n_data / kl * (running + damping) + (1 - (1 - beta) ** t) / var
        torch.testing.assert_close(opt.posterior_precision().diagonal(), want, rtol=1e-12, atol=0)
    assert float(opt.running.blocks["0"].diagonal.min()) >= (1 - beta) ** 3 * init


def test_noisy_kfac_config_builds_and_steps(caplog) -> None:
    """PyTorch-SSO's lenet_noisykfac.json (its optim/curv/fisher args) on a tiny model: converted with
    warnings for what is approximate, finite after a few steps."""
    config = {"optim_name": "VIOptimizer",
              "optim_args": {"curv_type": "Fisher", "curv_shapes": {"Conv2d": "Kron", "Linear": "Kron"},
                             "lr": 4e-3, "momentum": 0.9, "momentum_type": "preconditioned", "weight_decay": 0.1,
                             "num_mc_samples": 4, "val_num_mc_samples": 0, "kl_weighting": 0.2,
                             "prior_variance": 1},
              "curv_args": {"damping": 1e-4, "ema_decay": 0.333, "pi_type": "tracenorm"},
              "fisher_args": {"approx_type": "mc", "num_mc": 1}}
    model = _mlp()
    with caplog.at_level(logging.WARNING):
        opt = from_config(config, model, dataset_size=1000)
    assert isinstance(opt, torchsso2.VIOptimizer)
    assert opt.ema_decay == pytest.approx(1 - 0.333) and opt.damping == pytest.approx(1e-4 * 1000)
    assert opt.engine.kind.value == "fisher_mc" and opt.kl_weighting == 0.2
    assert "applied to the raw gradient" in caplog.text
    for x, y in _batches(3):
        opt.step(make_closure(opt, model, x, y))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_kfac_config_converts_numbers() -> None:
    config = {"optim_name": "SecondOrderOptimizer",
              "optim_args": {"curv_type": "Fisher", "curv_shapes": {"Conv2d": "Kron", "Linear": "Kron",
                                                                   "BatchNorm1d": "Diag", "BatchNorm2d": "Diag"},
                             "lr": 1e-3, "momentum": 0.9, "momentum_type": "preconditioned", "l2_reg": 1e-3,
                             "acc_steps": 1},
              "curv_args": {"damping": 1e-3, "ema_decay": 0.999, "pi_type": "tracenorm"},
              "fisher_args": {"approx_type": "mc", "num_mc": 1}}
    opt = from_config(config, _mlp())
    assert isinstance(opt, torchsso2.SecondOrderOptimizer)
    assert opt.ema_decay == pytest.approx(0.001)       # weight of the old estimate here
    assert opt.damping == pytest.approx(2e-3)           # damping + l2_reg
    assert opt.param_groups[0]["weight_decay"] == 1e-3  # l2_reg is coupled, as weight_decay here
    assert opt.param_groups[0]["momentum"] == 0.9
    assert opt.kfac_method == "inverse"
    # PyTorch-SSO's default momentum is 0 (torchsso2's native default is 0.9)
    assert SecondOrderOptimizer(_mlp(), "Cov", {"Linear": "Diag"}, {}).param_groups[0]["momentum"] == 0.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(lars=True), "LARS"),
    (dict(normalizing_weights=True), "normalizing_weights"),
    (dict(bias_correction=True), "bias_correction"),
    (dict(acc_steps=2), "acc_steps"),
    (dict(non_reg_for_bn=True), "non_reg_for_bn"),
    (dict(precondition_grad=False), "SGD"),
    (dict(momentum=0.9, grad_ema_decay=0.5), "two gradient buffers"),
])
def test_options_without_equivalent_raise(kwargs, match) -> None:
    with pytest.raises(NotImplementedError, match=match):
        SecondOrderOptimizer(_mlp(), "Cov", {"Linear": "Diag"}, {}, **kwargs)


@pytest.mark.parametrize("curv_kwargs,err,match", [
    ({"use_max_ema": True}, NotImplementedError, "use_max_ema"),
    ({"use_sqrt_ema": True}, NotImplementedError, "use_sqrt_ema"),
    ({"pi_type": "other"}, ValueError, "tracenorm"),
    ({"ema_decay": 0}, NotImplementedError, "first batch's curvature for good.*curv_update_interval"),
    ({"ema_decay": 1.5}, ValueError, "weight of the new batch"),
    ({"dampnig": 1}, TypeError, "dampnig"),
])
def test_bad_curv_kwargs(curv_kwargs, err, match) -> None:
    with pytest.raises(err, match=match):
        SecondOrderOptimizer(_mlp(), "Cov", {"Linear": "Diag"}, curv_kwargs)


def test_vi_options_without_equivalent_raise() -> None:
    with pytest.raises(NotImplementedError, match="warm-up"):
        VIOptimizer(_mlp(), 10, "Cov", {"Linear": "Diag"}, {}, warmup_kl_weighting_steps=100)
    with pytest.raises(NotImplementedError, match="no noise"):
        VIOptimizer(_mlp(), 10, "Cov", {"Linear": "Diag"}, {}, prior_variance=0)
    with pytest.raises(ValueError, match="curv_type"):
        VIOptimizer(_mlp(), 10, "Kron", {"Linear": "Diag"}, {})
    with pytest.raises(ValueError, match="curv_shapes"):
        VIOptimizer(_mlp(), 10, "Cov", {"Linear": "KFAC"}, {})


def test_native_api_names_the_new_name_for_old_ones() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="'Cov'.*here it is 'empirical_fisher'"):
        torchsso2.SecondOrderOptimizer(model, curvature="Cov")
    with pytest.raises(ValueError, match="'Fisher'.*'fisher_mc'"):
        torchsso2.VIOptimizer(model, 10, curvature="Fisher")
    with pytest.raises(ValueError, match="'Kron'.*here it is 'kfac'"):
        torchsso2.SecondOrderOptimizer(model, approx="Kron")
    # the same name in another case is taken (choices are case-insensitive), 'Fisher' excepted above
    diag = torchsso2.SecondOrderOptimizer(model, approx={"Linear": "Diag"})
    assert {a.value for a in diag.engine.approx.values()} == {"diag"}
    # PyTorch-SSO's positional call reaching the native class
    with pytest.raises(TypeError, match="torchsso2.compat.pytorch_sso.SecondOrderOptimizer"):
        torchsso2.SecondOrderOptimizer(model, "Fisher", {"Linear": "Kron"}, {"damping": 1e-3})
    with pytest.raises(TypeError, match="torchsso2.compat.pytorch_sso.VIOptimizer"):
        torchsso2.VIOptimizer(model, 10, "Cov")


def test_vi_prediction_as_pytorch_sso() -> None:
    """prediction(data, mc): mc=0 evaluates at the mean; mc>0 averages softmax over posterior samples."""
    model = _mlp()
    (x, y), = _batches(1)
    opt = VIOptimizer(model, 20, "Cov", {"Linear": "Diag"}, {"damping": 1e-3, "ema_decay": 0.1},
                      init_precision=1e-2, val_num_mc_samples=3, num_mc_samples=1)
    at_mean = opt.prediction(x, mc=0)
    torch.testing.assert_close(at_mean, torch.softmax(model(x), -1).detach())
    mean, probs = opt.prediction(x, keep_probs=True)
    assert len(probs) == 3 and mean.shape == (len(x), 2)
    torch.testing.assert_close(mean.sum(-1), torch.ones(len(x), dtype=mean.dtype))
    assert not torch.allclose(mean, at_mean)                # the samples moved the weights
    torch.testing.assert_close(torch.softmax(model(x), -1).detach(), at_mean)  # and the mean is back
    with pytest.raises(ValueError, match="mc"):
        opt.prediction(x, mc=-1)


def test_failed_factored_decomposition_follows_the_policy() -> None:
    """A K-FAC factor that cannot be inverted (NaN after an EMA) is the native policy's business:
    "raise" raises NonFiniteError; "skip" keeps the previous decompositions."""
    model = _mlp()
    (x, y), = _batches(1)
    for policy in ("raise", "skip"):
        opt = SecondOrderOptimizer(model, "Cov", {"Linear": "Kron"}, {"damping": 1e-2}, on_nonfinite=policy)
        opt.step(make_closure(opt, model, x, y))
        blk = opt.running.blocks["0"]
        before = blk.decomposition
        blk.left.fill_(float("nan"))
        if policy == "raise":
            with pytest.raises(torchsso2.NonFiniteError, match="decomposition failed"):
                opt._decompose(opt.damping)
        else:
            assert opt._decompose(opt.damping) is False and blk.decomposition is before


def test_example_configs_as_published():
    """The example configs as PyTorch-SSO publishes them: lenet_noisykfac's prior_precision is taken as
    prior_variance = 1/p; init_prec_ema given with init_precision is refused (tests/test_compat_audit_fixes.py
    takes it alone); a MultiheadAttention absent from curv_shapes gets a full block like any layer."""
    import torch.nn as nn
    from torchsso2.compat.pytorch_sso import SecondOrderOptimizer as SSO, from_config
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(72, 3))
    noisy = {"optim_name": "VIOptimizer",
             "optim_args": {"curv_type": "Fisher", "curv_shapes": {"Conv2d": "Kron", "Linear": "Kron"}, "lr": 4e-3,
                            "momentum": 0.9, "num_mc_samples": 4, "kl_weighting": 0.2, "prior_precision": 4},
             "curv_args": {"damping": 1e-4, "ema_decay": 0.333}, "fisher_args": {"approx_type": "mc", "num_mc": 1}}
    opt = from_config(noisy, model, dataset_size=50000)
    assert opt.prior_precision == pytest.approx(4.0)
    vogn = {"optim_name": "VIOptimizer", "optim_args": {"curv_type": "Cov", "init_prec_ema": 0.9}, "curv_args": {}}
    with pytest.raises(ValueError, match="both init_prec_ema and init_precision"):
        from_config({**vogn, "optim_args": {**vogn["optim_args"], "init_precision": 0.9}}, model, dataset_size=100)

    class TF(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.head = nn.Linear(4, 7)

        def forward(self, ids):
            h = self.emb(ids)
            return self.head(h + self.attn(h, h, h, need_weights=False)[0])
    opt = SSO(TF(), "Cov", {"Linear": "Kron"}, {})
    assert {n: a.value for n, a in opt.engine.approx.items()} == {
        "emb": "full", "attn": "full", "attn.out_proj": "full", "head": "kfac"}


def _sso_diag_reference(model, batches, lr, damping, beta, momentum=0.0, momentum_type="preconditioned",
                        grad_ema_decay=1.0, grad_ema_type="raw", wd=0.0):
    """PyTorch-SSO's step with 'Cov' and 'Diag' on both Linears, written out from secondorder.py's
    update_preprocess: raw buffers, the preconditioning by the damped EMA, ``+ wd·θ``, preconditioned
    buffers, ``θ ← θ − lr·g`` (each buffer replaces the gradient it accumulated)."""
    ws = [torch.cat([w, b[:, None]], 1) for w, b in _params(model)]
    ema, mom, avg = None, [0.0, 0.0], [0.0, 0.0]
    for x, y in batches:
        ins, outs, grads = _forward_by_hand([(w[:, :-1], w[:, -1]) for w in ws], x, y)
        fresh = [torch.einsum("ni,nj->ij", e ** 2, a ** 2) / len(x) for a, e in zip(ins, outs)]
        ema = fresh if ema is None else [beta * f + (1 - beta) * e for f, e in zip(fresh, ema)]
        for i, grad in enumerate(grads):
            def buffers(g, kind):
                if momentum > 0 and momentum_type == kind:
                    mom[i] = momentum * mom[i] + g
                    g = mom[i]
                if grad_ema_decay != 1 and grad_ema_type == kind:
                    avg[i] = (1 - grad_ema_decay) * avg[i] + grad_ema_decay * g
                    g = avg[i]
                return g
            g = buffers(grad, "raw") / (ema[i] + damping)
            ws[i] = ws[i] - lr * buffers(g + wd * ws[i], "preconditioned")
    return ws


@pytest.mark.parametrize("buffer", [
    dict(momentum=0.9, momentum_type="raw"),                       # lenet_kfac (dev-master): raw momentum + wd
    dict(grad_ema_decay=0.3),                                      # a raw gradient average (lr × d natively)
    dict(grad_ema_decay=0.3, grad_ema_type="preconditioned"),
    dict(momentum=0.9),
])
def test_decoupled_weight_decay_where_pytorch_sso_adds_it(buffer) -> None:
    """PyTorch-SSO adds wd·θ to the preconditioned gradient: inside a momentum / gradient EMA of
    preconditioned gradients, after one of raw gradients (it was put into the native buffer in every
    case: 2.6x the decay after 5 steps, 7.6x after 50, with raw momentum). The curvature is held at
    the first batch's (β = 1e-12), where the other momentum kind equals PyTorch-SSO's."""
    lr, damping, beta, wd = 0.1, 0.1, 1e-12, 0.05
    model = _mlp()
    batches = _batches(5)
    want = _sso_diag_reference(model, batches, lr, damping, beta, wd=wd, **buffer)
    opt = SecondOrderOptimizer(model, "Cov", {"Linear": "Diag"}, {"damping": damping, "ema_decay": beta},
                               lr=lr, weight_decay=wd, **buffer)
    for x, y in batches:
        opt.step(make_closure(opt, model, x, y))
    got = [torch.cat([model[j].weight, model[j].bias[:, None]], 1).detach() for j in (0, 2)]
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("buffer", [
    dict(momentum=0.9),                                            # lenet_noisykfac: preconditioned momentum + wd
    dict(grad_ema_decay=0.3, grad_ema_type="preconditioned"),
    dict(grad_ema_decay=0.3),
])
def test_vi_decoupled_weight_decay_where_pytorch_sso_adds_it(buffer) -> None:
    """The same for VIOptimizer, whose native momentum takes raw gradients: the decay's share of a
    preconditioned buffer is kept beside it (it was added outside the momentum: 0.19 relative off after
    5 steps). kl_weighting 1e-24 makes the weight noise and the prior's l2 negligible (the reference
    has neither), the curvature is held at the first batch's."""
    lr, damping, beta, wd, n = 0.1, 0.1, 1e-12, 0.05, 100
    model = _mlp()
    batches = _batches(5)
    want = _sso_diag_reference(model, batches, lr, damping, beta, wd=wd, **buffer)
    opt = VIOptimizer(model, n, "Cov", {"Linear": "Diag"}, {"damping": damping, "ema_decay": beta}, lr=lr,
                      weight_decay=wd, kl_weighting=1e-24, num_mc_samples=1, **buffer)
    for x, y in batches:
        opt.step(make_closure(opt, model, x, y))
    got = [torch.cat([model[j].weight, model[j].bias[:, None]], 1).detach() for j in (0, 2)]
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-8, atol=1e-12)
    if buffer.get("momentum") or buffer.get("grad_ema_type") == "preconditioned":
        assert "sso_decay_buffer" in opt.state_dict()["state"][0]  # checkpointed with the optimizer


def test_vi_prediction_of_binary_logits_is_the_sigmoid() -> None:
    """PyTorch-SSO's prediction: softmax over dim 1 of [N, C] logits, the sigmoid of [N] logits (the
    softmax ran over the batch), other shapes refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    opt = VIOptimizer(model, 20, "Cov", {"Linear": "Diag"}, {}, init_precision=1e-2, num_mc_samples=1)
    torch.testing.assert_close(opt.prediction(x, mc=0), torch.sigmoid(model(x)).detach())
    probs = opt.prediction(x, mc=3)
    assert probs.shape == (8,) and float(probs.sum()) != pytest.approx(1.0)
    seq = nn.Linear(3, 4).double()
    opt = VIOptimizer(seq, 20, "Cov", {"Linear": "Diag"}, {}, init_precision=1e-2)
    with pytest.raises(ValueError, match=r"\[N, C\].*\[N\].*native predict"):
        opt.prediction(torch.randn(2, 5, 3, dtype=torch.float64), mc=0)


def test_continual_learning_config_keys() -> None:
    """The continual-learning branch's VI keys: init_prec_ema is init_precision, prior_precision is
    1/prior_variance (lenet_vogn.json there), prior_mean must be 0; Distributed* configs name the
    native classes."""
    args = {"curv_type": "Cov", "curv_shapes": {"Linear": "Diag"}, "lr": 0.01, "grad_ema_decay": 0.1,
            "num_mc_samples": 10, "val_num_mc_samples": 0, "kl_weighting": 1, "acc_steps": 1}
    curv = {"damping": 0, "ema_decay": 0.001}
    branch = from_config({"optim_name": "VIOptimizer", "curv_args": curv,
                          "optim_args": {**args, "init_prec_ema": 8e-3, "prior_precision": 4, "prior_mean": 0}},
                         _mlp(), dataset_size=500)
    master = VIOptimizer(_mlp(), 500, curv_kwargs=curv, init_precision=8e-3, prior_variance=0.25, **args)
    torch.testing.assert_close(branch.posterior_precision(), master.posterior_precision())
    assert branch.prior_precision == pytest.approx(4.0)
    with pytest.raises(NotImplementedError, match="prior_mean=0.5"):
        from_config({"optim_name": "VIOptimizer", "curv_args": curv,
                     "optim_args": {**args, "prior_mean": 0.5}}, _mlp(), dataset_size=500)
    for name, native in (("DistributedSecondOrderOptimizer", "SecondOrderOptimizer"),
                         ("DistributedVIOptimizer", "VIOptimizer")):
        with pytest.raises(ValueError, match=f"one process.*torchsso2.{native}"):
            from_config({"optim_name": name, "optim_args": args, "curv_args": curv}, _mlp(), dataset_size=500)


def test_refusals_in_pytorch_sso_terms() -> None:
    """'Hessian' with 'Kron' names curv_shapes (not the native approx/kind); acc_steps > 1 says how to
    accumulate in the closure so the step equals PyTorch-SSO's (the losses scaled by 1/acc_steps: the
    gradients add up over the backward passes)."""
    with pytest.raises(NotImplementedError, match=r"curv_type='Hessian' with curv_shapes 'Kron' for \['Linear'\]"):
        SecondOrderOptimizer(_mlp(), "Hessian", {"Linear": "Kron"}, {})
    with pytest.raises(NotImplementedError, match=r"1/2.*targets=y"):
        SecondOrderOptimizer(_mlp(), "Cov", {"Linear": "Diag"}, {}, acc_steps=2)


def test_accumulation_as_the_acc_steps_message_says() -> None:
    """Two micro-batches in one closure, each mean loss × 1/2, with the labels as targets: the step of
    the whole batch (PyTorch-SSO's acc_steps=2 averages the micro-batches' gradients and curvature)."""
    (x, y), = _batches(1, n=8)
    steps = []
    for split in (False, True):
        model = _mlp()
        opt = SecondOrderOptimizer(model, "Cov", {"Linear": "Kron"}, {"damping": 0.1}, lr=0.1)

        def closure():
            opt.zero_grad()
            parts = [(x, y)] if not split else [(x[:4], y[:4]), (x[4:], y[4:])]
            outs, total = [], 0.0
            for xs, ys in parts:
                out = model(xs)
                loss = F.cross_entropy(out, ys) / len(parts)
                loss.backward()
                outs.append(out)
                total = total + loss.detach()
            return total, torch.cat(outs)
        opt.step(closure, targets=y)
        steps.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(steps[1], steps[0], rtol=1e-10, atol=1e-12)


def test_weight_decay_after_a_raw_average_follows_the_groups_lr_from_zero() -> None:
    """Built with lr=0 (a warm-up from 0 set on the groups later), the decay after a raw gradient EMA is
    lr·wd·θ at the lr the groups hold then (PyTorch-SSO's lr)."""
    moved = []
    for lr0 in (0.05, 0.0):
        model = _mlp()
        opt = SecondOrderOptimizer(model, "Cov", {"Linear": "Diag"}, {"damping": 0.1}, lr=lr0, grad_ema_decay=0.2,
                                   weight_decay=0.1)
        for g in opt.param_groups:
            g["lr"] = 0.05
        x, y = _batches(1)[0]
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        opt.step(make_closure(opt, model, x, y))
        moved.append(torch.cat([p.detach().flatten() for p in model.parameters()]) - before)
    torch.testing.assert_close(moved[1], moved[0], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("face", ["so", "vi"])
@pytest.mark.parametrize("ema_type", ["raw", "preconditioned"])
def test_groups_hold_pytorch_sso_lr_under_a_gradient_ema(face: str, ema_type: str) -> None:
    """With grad_ema_decay d the native step runs at lr·d (momentum 1 − d), but the groups hold
    PyTorch-SSO's lr: a script that reads it, sets it (a warm-up) or schedules it uses PyTorch-SSO's
    units. Setting the groups' lr to L after a step gives the same run as building with lr=L and
    continuing (bit for bit), and the groups read L before and after the step."""
    def run(lr_built: float, lr_set: Optional[float]) -> Tensor:
        model = _mlp()
        if face == "so":
            opt = SecondOrderOptimizer(model, "Cov", {"Linear": "Kron"}, {"damping": 0.1}, lr=lr_built,
                                       grad_ema_decay=0.2, grad_ema_type=ema_type, weight_decay=0.1)
        else:
            opt = VIOptimizer(model, 50, "Cov", {"Linear": "Diag"}, {"damping": 1e-2}, lr=lr_built,
                              grad_ema_decay=0.2, grad_ema_type=ema_type, weight_decay=0.1,
                              num_mc_samples=1, init_precision=1e-2)
        assert [g["lr"] for g in opt.param_groups] == [lr_built]
        for i, (x, y) in enumerate(_batches(3)):
            if i == 1 and lr_set is not None:
                for g in opt.param_groups:
                    g["lr"] = lr_set
            opt.step(make_closure(opt, model, x, y))
        assert [g["lr"] for g in opt.param_groups] == [lr_set if lr_set is not None else lr_built]
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    same = run(0.05, None)
    # built at 0.05 and set to 0.05 after the first step: identical (the groups' lr is not converted twice)
    torch.testing.assert_close(run(0.05, 0.05), same, rtol=0, atol=0)
    # and a real change of lr changes the run
    assert not torch.equal(run(0.05, 0.01), same)


def test_prior_ramp_before_any_update_and_decay_buffer_dtype() -> None:
    """The init_precision ramp with no curvature update yet (a state loaded from before the first step)
    is the whole prior's absence, not an error (PyTorch-SSO's default ema_decay 1 raised
    ZeroDivisionError); the decay buffer follows model.double()."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = VIOptimizer(model, 50, "Cov", {"Linear": "Diag"}, {"damping": 1e-2}, init_precision=1e-2,
                      momentum=0.9, weight_decay=0.1, num_mc_samples=1)
    opt.running.num_updates = 0
    assert opt.precision_shift == pytest.approx(opt.damping)
    x, y = _batches(1)[0]
    opt.step(make_closure(opt, model, x.float(), y))
    model.double()
    opt.step(make_closure(opt, model, x, y))
    assert opt.state[model[0].weight]["sso_decay_buffer"].dtype == torch.float64


def test_vi_kron_init_precision_is_the_per_example_curvature_start() -> None:
    """As test_vi_init_precision_is_the_per_example_curvature_start, with 'Kron' blocks: PyTorch-SSO's
    element_wise_init starts each Kronecker factor at √init·I, so A ⊗ G = init·I and the posterior
    precision before any step is (N/kl)(init + λ)·I over all 26 parameters (weights and biases; a factor
    started at init·I would give init²). Reference: the hand formula in float64; 1e-12 is rounding."""
    n_data, damping, kl, var, init, beta = 50, 1e-3, 0.5, 2.0, 8e-3, 0.3
    model = _mlp()
    opt = VIOptimizer(model, n_data, "Cov", {"Linear": "Kron"}, {"damping": damping, "ema_decay": beta},
                      kl_weighting=kl, prior_variance=var, init_precision=init)
    for name in ("0", "2"):
        block = opt.running.blocks[name]
        torch.testing.assert_close(torch.kron(block.A, block.G),
                                   init * torch.eye(block.A.shape[0] * block.G.shape[0], dtype=torch.float64),
                                   rtol=1e-12, atol=1e-15)
    prec = opt.posterior_precision()
    torch.testing.assert_close(prec, n_data / kl * (init + damping) * torch.eye(26, dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)


def test_native_keywords_the_compat_classes_set_name_where_pytorch_sso_takes_them() -> None:
    """damping=/ema_decay= go in curv_kwargs there (Python's "multiple values for keyword" blamed a
    keyword given once)."""
    for kw, where in ((dict(damping=1e-3), r"damping= comes from curv_kwargs"),
                      (dict(ema_decay=0.1), r"ema_decay= comes from curv_kwargs"),
                      (dict(approx="kfac"), r"approx= comes from curv_shapes"),
                      (dict(mc_samples=2), r"mc_samples= comes from fisher_args")):
        with pytest.raises(TypeError, match=where):
            SecondOrderOptimizer(_mlp(), "Cov", {"Linear": "Kron"}, {}, **kw)
        with pytest.raises(TypeError, match=where + r".*native torchsso2.VIOptimizer"):
            VIOptimizer(_mlp(), 50, "Cov", {"Linear": "Diag"}, {}, **kw)
    with pytest.raises(TypeError, match="mc_group_id.*one process"):
        VIOptimizer(_mlp(), 50, "Cov", {"Linear": "Diag"}, {}, mc_group_id=0)


def test_continual_learning_keys_given_to_the_constructor() -> None:
    """prior_precision / init_prec_ema / prior_mean=0 of the continual-learning branch's constructor: the
    same optimizer as from_config builds (and as master's prior_variance / init_precision)."""
    curv = {"damping": 1e-3, "ema_decay": 0.01}
    direct = VIOptimizer(_mlp(), 500, "Cov", {"Linear": "Diag"}, curv, prior_precision=4.0, init_prec_ema=8e-3,
                         prior_mean=0)
    master = VIOptimizer(_mlp(), 500, "Cov", {"Linear": "Diag"}, curv, prior_variance=0.25, init_precision=8e-3)
    torch.testing.assert_close(direct.posterior_precision(), master.posterior_precision())
    assert direct.prior_precision == pytest.approx(4.0)
    with pytest.raises(ValueError, match="both prior_precision=4.0 and prior_variance=3"):
        VIOptimizer(_mlp(), 500, "Cov", {"Linear": "Diag"}, curv, prior_precision=4.0, prior_variance=3)
    with pytest.raises(NotImplementedError, match="prior_mean=0.5"):
        VIOptimizer(_mlp(), 500, "Cov", {"Linear": "Diag"}, curv, prior_mean=0.5)


def test_a_class_absent_from_curv_shapes_with_a_huge_full_block_is_refused_at_construction() -> None:
    """PyTorch-SSO's absent shape is a full block: for a 1800→300 Linear that is 540,300² entries (the
    first step failed allocating 1.2 TB); small layers keep it."""
    big = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(1800, 300))
    with pytest.raises(ValueError, match=r"no entry for 'Linear'.*540300 parameters.*curv_shapes\['Linear'\]"):
        SecondOrderOptimizer(big, "Cov", {"Conv2d": "Kron"}, {"damping": 1e-3})
    opt = SecondOrderOptimizer(_mlp(), "Cov", {}, {"damping": 1e-3})
    assert set(opt.engine.approx[n].value for n in opt.engine.layouts) == {"full"}
    # a module left out (skip_modules, params=) gets no block: nothing to refuse
    SecondOrderOptimizer(big, "Cov", {"Conv2d": "Kron"}, {"damping": 1e-3}, skip_modules=[nn.Linear])
    SecondOrderOptimizer(big, "Cov", {"Conv2d": "Kron"}, {"damping": 1e-3}, params=big[0].parameters())


@pytest.mark.parametrize("face", ["so", "vi"])
def test_a_checkpoint_from_when_the_groups_held_the_native_lr_resumes_at_the_same_lr(face: str) -> None:
    """Checkpoints saved before the groups held PyTorch-SSO's lr under a gradient EMA hold lr·d and no
    'groups_lr' mark: loading divides by d, so the run goes on at the lr it had."""
    def build():
        if face == "so":
            return SecondOrderOptimizer(_mlp(), "Cov", {"Linear": "Kron"}, {"damping": 0.1}, lr=0.05,
                                        grad_ema_decay=0.2)
        return VIOptimizer(_mlp(), 50, "Cov", {"Linear": "Diag"}, {"damping": 1e-2}, lr=0.05, grad_ema_decay=0.2,
                           num_mc_samples=1, init_precision=1e-2)
    opt = build()
    sd = opt.state_dict()
    assert sd["torchsso2"]["extra"]["groups_lr"] == "pytorch-sso"
    old = {**sd, "torchsso2": {**sd["torchsso2"], "extra": {k: v for k, v in sd["torchsso2"]["extra"].items()
                                                            if k != "groups_lr"}},
           "param_groups": [{**g, "lr": g["lr"] * 0.2} for g in sd["param_groups"]]}
    for saved in (sd, old):
        fresh = build()
        fresh.load_state_dict(saved)
        assert [g["lr"] for g in fresh.param_groups] == pytest.approx([0.05])


@pytest.mark.parametrize("face", ["so", "vi"])
def test_a_compat_checkpoint_with_a_gradient_ema_is_refused_by_the_native_class(face: str) -> None:
    """Both faces tag their checkpoints with the native name; under a gradient EMA the compat groups' lr is
    applied times d, so the native class would step 1/d times as far (17x in the probe): a ValueError.
    Without the EMA (d = 1) the groups' lr is the native one and the checkpoint loads."""
    def compat(d: float):
        if face == "so":
            return SecondOrderOptimizer(_mlp(), "Cov", {"Linear": "Kron"}, {"damping": 0.1}, lr=0.05,
                                        grad_ema_decay=d)
        return VIOptimizer(_mlp(), 50, "Cov", {"Linear": "Diag"}, {"damping": 1e-2}, lr=0.05, grad_ema_decay=d,
                           num_mc_samples=1, init_precision=1e-2)

    def native():
        if face == "so":
            return torchsso2.SecondOrderOptimizer(_mlp(), lr=0.05, approx={nn.Linear: "kfac"},
                                                  curvature="empirical_fisher")
        return torchsso2.VIOptimizer(_mlp(), dataset_size=50, lr=0.05, curvature="empirical_fisher")
    sd = compat(0.2).state_dict()
    assert sd["torchsso2"]["extra"]["lr_scale"] == 0.2
    opt = native()
    groups = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"saved by torchsso2\.compat\.pytorch_sso\.\w+Optimizer, whose updates apply "
                                         r"the groups' lr times 0\.2 .*load it into the compat class"):
        opt.load_state_dict(sd)
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups] == groups
    unrecorded = {**sd, "torchsso2": {**sd["torchsso2"], "extra": {k: v for k, v in sd["torchsso2"]["extra"].items()
                                                                   if k != "lr_scale"}}}
    with pytest.warns(UserWarning, match=r"did not record its gradient EMA.*right for d = 1 \(the default\)"):
        native().load_state_dict(unrecorded)  # (saved before the scale was recorded: d = 1 is the common case)
    compat(0.2).load_state_dict(sd)  # the compat class takes it
    plain = compat(1.0).state_dict()
    fresh = native()
    fresh.load_state_dict(plain)
    assert [g["lr"] for g in fresh.param_groups] == pytest.approx([0.05])


def test_val_num_mc_samples_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match=r"val_num_mc_samples=-1 must be an int >= 0"):
        VIOptimizer(_mlp(), 50, "Cov", {"Linear": "Diag"}, {}, val_num_mc_samples=-1)


def test_vi_init_precision_starts_an_embeddings_kfac_input_factor_as_a_diagonal() -> None:
    """The start init·I of a K-FAC Embedding: its A is a diagonal [V] as every fresh one (it was a dense [V, V]
    identity, into which the EMA broadcast the fresh [V] counts: a non-symmetric rank-1 factor, no error)."""
    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(6, 4), nn.Linear(4, 3)

        def forward(self, t: Tensor) -> Tensor:
            return self.head(self.emb(t).mean(1))
    torch.manual_seed(0)
    model = Tokens()
    beta, init = 0.3, 1.0
    opt = VIOptimizer(model, 100, "Fisher", {"Embedding": "Kron", "Linear": "Kron"}, {"ema_decay": beta},
                      init_precision=init, num_mc_samples=1)
    start = opt.running.blocks["emb"].A.clone()
    torch.testing.assert_close(start, torch.ones(6))
    tokens, y = torch.randint(0, 6, (8, 3)), torch.randint(0, 3, (8,))
    opt.step(make_closure(opt, model, tokens, y))
    counts = torch.bincount(tokens.reshape(-1), minlength=6).float() / tokens.numel()
    torch.testing.assert_close(opt.running.blocks["emb"].A, (1 - beta) * start + beta * counts)


def test_compat_vi_init_precision_beyond_float32_is_refused():
    """As the native VIOptimizer's: every decomposition failed and every step was skipped."""
    with pytest.raises(ValueError, match=r"init_precision=1e\+300 is out of range"):
        VIOptimizer(_mlp(), 100, "Cov", {"Linear": "Diag"}, {"damping": 1e-3}, init_precision=1e300)
