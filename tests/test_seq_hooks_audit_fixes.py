"""Sequence masks, K-FAC-reduce layouts, hooks that use a layer's parameters, functional calls,
torch.func transforms in a closure, copies of a KFACPreconditioner, and overflowing VI curvature:
each against a brute-force float64 reference or the run that never saw the bad batch."""
from __future__ import annotations

import copy
import math
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, jacrev, vmap

import curvature
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner
from optim_helpers import make_closure

V, D, C = 6, 3, 3


def _flat_fn(model: nn.Module, names: List[str], args: Tuple[Tensor, ...],
             select: Callable[[Tensor], Tensor] = lambda o: o) -> Tuple[Callable[[Tensor], Tensor], Tensor]:
    """``θ ↦ select(model(*args))`` over the parameters ``names`` (flat), and ``θ`` now."""
    params = dict(model.named_parameters())
    shapes = [params[n].shape for n in names]
    theta = torch.cat([params[n].detach().reshape(-1) for n in names])

    def f(t: Tensor) -> Tensor:
        ps, i = {}, 0
        for n, s in zip(names, shapes):
            ps[n] = t[i:i + s.numel()].view(s)
            i += s.numel()
        return select(functional_call(model, ps, args))
    return f, theta


def _ggn(f: Callable[[Tensor], Tensor], theta: Tensor) -> Tensor:
    """The GGN of the mean cross-entropy over the rows of ``f(θ)`` ([R, C] logits)."""
    out = f(theta).detach()
    p = out.softmax(-1)
    h = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    j = jacrev(f)(theta)
    return torch.einsum("rcp,rcd,rdq->pq", j, h, j) / out.shape[0]


def _block_mask(sizes: List[int]) -> Tensor:
    return torch.block_diag(*[torch.ones(s, s, dtype=torch.float64) for s in sizes])


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---- padding masks: sequences with different numbers of loss rows --------------------------------
def _tok_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, D), nn.Tanh(), nn.Linear(D, C)).double()


UNEVEN = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)  # 3 + 1 valid tokens: M = 4 = 2N


@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
def test_exact_fisher_refuses_an_uneven_padding_mask(approx: str) -> None:
    """3 + 1 valid tokens: the rows' count is a multiple of N, but rows 2 and 3 are not one sequence's;
    the exact Fisher's per-position vectors would mix them (0.38 off the GGN before): a ValueError."""
    model = _tok_model()
    x, y = torch.randint(0, V, (2, 4)), torch.randint(0, C, (2, 4))
    with pytest.raises(ValueError, match="padding mask"):
        curvature.compute(model, x, y[UNEVEN], kind="fisher", approx=approx, output_selector=lambda o: o[UNEVEN])


def test_uneven_padding_mask_under_the_other_kinds_matches_brute_force() -> None:
    """The same mask: the empirical Fisher sums each sequence's valid rows (module-side), exact; the
    Monte-Carlo Fisher takes any mask; the exact Fisher of an even mask stays exact."""
    torch.manual_seed(1)
    model = _tok_model()
    x, y = torch.randint(0, V, (2, 4)), torch.randint(0, C, (2, 4))
    names = [n for n, _ in model.named_parameters()]
    sel = lambda o: o[UNEVEN]  # noqa: E731
    f, theta = _flat_fn(model, names, (x,), sel)
    yv = y[UNEVEN]
    out = f(theta).detach()
    j = jacrev(f)(theta)
    r = out.softmax(-1) - F.one_hot(yv, C).double()
    per_row = torch.einsum("rc,rcp->rp", r, j)
    per_seq = torch.zeros(2, per_row.shape[1], dtype=torch.float64).index_add_(0, UNEVEN.nonzero()[:, 0], per_row)
    sizes = [V * D, C * D + C]
    ef = per_seq.t() @ per_seq / out.shape[0] * _block_mask(sizes)
    c = curvature.compute(model, x, yv, kind="empirical_fisher", approx="full", output_selector=sel)
    assert _rel(c.dense(), ef) < 1e-12
    ggn = _ggn(f, theta) * _block_mask(sizes)
    c = curvature.compute(model, x, yv, kind="fisher_mc", approx="full", output_selector=sel, mc_samples=20000,
                          generator=torch.Generator().manual_seed(0))
    assert _rel(c.dense(), ggn) < 0.05  # ~0.5% at 20000 samples
    even = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    f2, _ = _flat_fn(model, names, (x,), lambda o: o[even])
    c = curvature.compute(model, x, y[even], kind="fisher", approx="full", output_selector=lambda o: o[even])
    assert _rel(c.dense(), _ggn(f2, theta) * _block_mask(sizes)) < 1e-12


def test_a_module_with_fewer_positions_than_the_loss() -> None:
    """A module run on a prefix of the sequence (a cross-attention memory shorter than the target):
    the exact Fisher's position-local shortcut does not apply (an IndexError before); full and diagonal
    blocks equal the brute-force GGN."""
    class Prefix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.ctx, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, C)

        def forward(self, x: Tensor) -> Tensor:
            h = self.emb(x)
            return self.head(h + self.ctx(h[:, :2]).mean(1, keepdim=True))

    torch.manual_seed(0)
    model = Prefix().double()
    x, y = torch.randint(0, V, (2, 3)), torch.randint(0, C, (2, 3))
    names = [n for n, _ in model.named_parameters()]
    f, theta = _flat_fn(model, names, (x,), lambda o: o.reshape(-1, C))
    ggn = _ggn(f, theta) * _block_mask([V * D, D * D + D, C * D + C])
    for approx in ("full", "diag"):
        c = curvature.compute(model, x, y, kind="fisher", approx=approx)
        dense = c.dense()
        assert _rel(dense, ggn if approx == "full" else torch.diag(ggn.diagonal())) < 1e-12


# ---- K-FAC-reduce: the first dimension must be the examples, the second the positions ------------
class SeqFirst(nn.Module):
    """A sequence-first feed-forward after a position-mixing op, as nn.TransformerEncoderLayer(batch_first=False)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x).cumsum(1).transpose(0, 1)  # [T, N, d]
        return self.head(torch.tanh(self.fc(h)).transpose(0, 1))  # [N, T, C]


@pytest.mark.parametrize("kind", ["fisher", "fisher_mc", "empirical_fisher"])
def test_reduce_refuses_a_sequence_first_linear(kind: str) -> None:
    torch.manual_seed(0)
    model = SeqFirst().double()
    x, y = torch.randint(0, V, (3, 4)), torch.randint(0, C, (3, 4))
    with pytest.raises(ValueError, match="batch_first=True"):
        curvature.compute(model, x, y, kind=kind, approx="kfac", kfac_approx="reduce")
    if kind != "fisher":  # K-FAC-expand takes any layout (the exact Fisher needs the examples first anyway)
        curvature.compute(model, x, y, kind=kind, approx="kfac", kfac_approx="expand")


def test_reduce_refuses_a_sequence_first_transformer_layer_in_the_optimizer() -> None:
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, 4)
            self.enc = nn.TransformerEncoderLayer(4, 1, dim_feedforward=8, dropout=0.0)  # batch_first=False
            self.head = nn.Linear(4, C)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.enc(self.emb(x).transpose(0, 1)).transpose(0, 1))

    torch.manual_seed(0)
    model = LM().double()
    x, y = torch.randint(0, V, (3, 5)), torch.randint(0, C, (3, 5))
    opt = SecondOrderOptimizer(model, kfac_approx="reduce")

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, C), y.reshape(-1))
        loss.backward()
        return loss, out
    with pytest.raises(ValueError, match=r"enc\.linear1.*batch_first=True"):
        opt.step(closure)


def test_reduce_refuses_a_linear_on_reshaped_rows_and_keeps_batch_first_models() -> None:
    """``head(h.reshape(-1, d))`` under reduce was silently K-FAC-expand (0.44-0.86 off reduce's A);
    the same model with the head before the reshape reduces per sequence as defined."""
    class M(nn.Module):
        def __init__(self, rows: bool) -> None:
            super().__init__()
            self.emb, self.head, self.rows = nn.Embedding(V, D), nn.Linear(D, C), rows

        def forward(self, x: Tensor) -> Tensor:
            h = torch.tanh(self.emb(x)).cumsum(1)
            return self.head(h.reshape(-1, D)) if self.rows else self.head(h).reshape(-1, C)

    torch.manual_seed(0)
    x, y = torch.randint(0, V, (2, 3)), torch.randint(0, C, (6,))
    with pytest.raises(ValueError, match="reshaped activations"):
        curvature.compute(M(True).double(), x, y, kind="fisher", approx="kfac", kfac_approx="reduce")
    model = M(False).double()
    c = curvature.compute(model, x, y, kind="empirical_fisher", approx="kfac", kfac_approx="reduce")
    h = torch.tanh(model.emb(x)).cumsum(1).detach()
    a = torch.cat([h, torch.ones(2, 3, 1, dtype=torch.float64)], -1).mean(1)  # mean over each sequence
    torch.testing.assert_close(c.blocks["head"].A, a.t() @ a / 2, rtol=1e-12, atol=1e-14)


# ---- hooks and functional calls -------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


@pytest.mark.parametrize("hook", ["recompute", "add", "pre"])
@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher"])
def test_a_hook_computing_with_its_layers_parameters_is_refused(hook: str, kind: str) -> None:
    """A forward (pre-)hook of a covered layer that computes with its parameters (a fake-quantized
    weight) reaches the output past the recorded call: its Fisher block was zero or 0.28-0.56 off;
    now the functional-use ValueError."""
    model = _mlp()
    if hook == "recompute":
        model[2].register_forward_hook(lambda m, i, o: F.linear(i[0], m.weight + (m.weight.round() - m.weight).detach(),
                                                                 m.bias))
    elif hook == "add":
        model[2].register_forward_hook(lambda m, i, o: o + F.linear(i[0], 0.5 * m.weight))
    else:
        model[2].register_forward_pre_hook(lambda m, i: (i[0] * m.weight.sum(),))
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    with pytest.raises(ValueError, match=r"\(pre-\)hook of the layer"):
        curvature.compute(model, x, y, kind=kind, approx="full")


def test_a_hook_without_the_parameters_is_still_part_of_the_curvature() -> None:
    model = _mlp()
    model[2].register_forward_hook(lambda m, i, o: 2.0 * o)
    model[0].register_forward_pre_hook(lambda m, i: (i[0] + 1.0,))
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    names = [n for n, _ in model.named_parameters()]
    f, theta = _flat_fn(model, names, (x,))
    c = curvature.compute(model, x, y, kind="fisher", approx="full")
    assert _rel(c.dense(), _ggn(f, theta) * _block_mask([25, 18])) < 1e-12


def test_hessian_diagonal_of_a_layer_called_with_other_weights() -> None:
    """``functional_call(layer, {"weight": 2 * W})``: the fast diagonal path took the call as the layer's
    own weights (0.25x the true diagonal, a 3x too large step); it now takes the general path."""
    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return functional_call(self.inner, {"weight": 2 * self.inner.weight, "bias": self.inner.bias}, (x,))

    torch.manual_seed(0)
    model = Wrap().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    w, b = model.inner.weight, model.inner.bias
    theta = torch.cat([w.detach().reshape(-1), b.detach()])
    ref = hessian(lambda t: F.cross_entropy(F.linear(x, 2 * t[:12].view(3, 4), t[12:]), y))(theta).diagonal()
    c = curvature.compute(model, x, y, kind="hessian", approx="diag")
    torch.testing.assert_close(c.dense().diagonal(), ref, rtol=1e-10, atol=1e-14)


def test_a_module_called_twice_names_the_ways_out() -> None:
    class Rnn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(torch.tanh(self.cell(torch.tanh(self.cell(x)))))

    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match=r"skip_modules=\['\^cell\$'\].*kind='hessian'"):
        curvature.compute(Rnn(), x, y, kind="fisher", approx="diag")


# ---- torch.func transforms of the model inside a closure ----------------------------------------
@pytest.mark.parametrize("make", ["sso", "vi"])
def test_torch_func_transforms_inside_the_closure_are_left_alone(make: str) -> None:
    """Per-sample gradients (vmap(grad(functional_call(model, ...)))), torch.func.grad and jvp of the
    model inside the closure, for logging: a crash before; now the step equals the one without them."""
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))

    def logging_transforms(m: nn.Module) -> None:
        ps = {k: v.detach() for k, v in m.named_parameters()}
        loss = lambda p, xi, yi: F.cross_entropy(functional_call(m, p, (xi[None],)), yi[None])  # noqa: E731
        vmap(grad(loss), in_dims=(None, 0, 0))(ps, x, y)
        grad(lambda p: F.cross_entropy(functional_call(m, p, (x,)), y))(ps)
        torch.func.jvp(lambda p: functional_call(m, p, (x,)), (ps,), ({k: torch.ones_like(v) for k, v in ps.items()},))

    results = []
    for extra in (False, True):
        model = _mlp()
        opt = SecondOrderOptimizer(model, lr=0.1) if make == "sso" else VIOptimizer(model, dataset_size=100, lr=0.1,
                                                                                   seed=0)

        closure = make_closure(opt, model, x, y, after_backward=(lambda: logging_transforms(model)) if extra else None)
        torch.manual_seed(0)
        for _ in range(3):
            opt.step(closure)
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(results[0], results[1])


# ---- copy.deepcopy((model, KFACPreconditioner)) ---------------------------------------------------
def test_deepcopy_of_model_and_preconditioner_trains_the_copy() -> None:
    """The copy's hooks sit on the copied model (its factors stayed stale before: 15% off a fresh
    preconditioner); the original is left alone and the copied modules carry no stale hook."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(6))

    def net() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))

    def step(m: nn.Module, p: KFACPreconditioner, scale: float) -> None:
        m.zero_grad()
        F.cross_entropy(m(x * scale), y).backward()
        p.step()

    model = net()
    pre = KFACPreconditioner(model, lr=0.1, damping=0.01)
    step(model, pre, 1.0)
    before = copy.deepcopy(pre.state_dict())
    model2, pre2 = copy.deepcopy((model, pre))
    assert all(len(m._forward_hooks) == len(m2._forward_hooks)
               for m, m2 in zip(model.modules(), model2.modules()))
    step(model2, pre2, 3.0)
    ref_model = net()
    ref = KFACPreconditioner(ref_model, lr=0.1, damping=0.01)
    step(ref_model, ref, 1.0)
    step(ref_model, ref, 3.0)
    for p2, pr in zip(model2.parameters(), ref_model.parameters()):
        assert torch.equal(p2.grad, pr.grad)
    after = pre.state_dict()
    for name in before["layers"]:
        for key, value in before["layers"][name].items():
            if isinstance(value, Tensor):
                assert torch.equal(after["layers"][name][key], value)


# ---- VIOptimizer: a huge finite gradient overflows the curvature update ----------------------------
@pytest.mark.parametrize("kwargs", [{}, {"num_mc_samples": 2}, {"ema_decay": 0.9}])
def test_vi_curvature_overflow_is_a_skipped_step(kwargs: Dict) -> None:
    """A gradient entry of 1e30 (finite in float32): the curvature update overflowed to inf and stayed
    (every later step skipped, the momentum took the gradient in); now the step is skipped and the
    state equals the run that never saw the batch."""
    def batch(i: int) -> Tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(100 + i)
        return torch.randn(10, 4, generator=g), torch.randint(0, 3, (10,), generator=g)

    def run(bad_at: int = -1) -> Tuple[nn.Module, VIOptimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        o = VIOptimizer(m, dataset_size=100, seed=3, **kwargs)
        for i in range(6):
            x, y = batch(i)
            for bad in ([True, False] if i == bad_at else [False]):
                def huge(bad: bool = bad) -> None:
                    if bad:
                        m[2].weight.grad[0, 0] = 1e30
                o.step(make_closure(o, m, x, y, after_backward=huge))
        return m, o

    ma, oa = run()
    mb, ob = run(bad_at=2)
    assert ob.num_skipped == 1 and oa.num_skipped == 0 and ob.num_steps == oa.num_steps
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)
    for name, blk in oa.running.blocks.items():
        assert torch.equal(blk.diagonal, ob.running.blocks[name].diagonal)


# ---- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fisher", "fisher_mc", "empirical_fisher", "hessian"])
def test_compute_with_a_non_finite_input_says_so(kind: str) -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="3 non-finite \(NaN"):
        curvature.compute(model, x, y, kind=kind, approx="full")


@pytest.mark.parametrize("make", ["sso", "vi", "vi-kfac"])
def test_step_targets_and_closure_loss_are_checked(make: str) -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = {"sso": lambda: SecondOrderOptimizer(model), "vi": lambda: VIOptimizer(model, dataset_size=10),
           "vi-kfac": lambda: VIOptimizer(model, dataset_size=10, approx="kfac")}[make]()
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))

    def closure(swap: bool = False):
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return (out, loss) if swap else (loss, out)
    with pytest.raises(TypeError, match="targets must be a Tensor.*got str 'abc'"):
        opt.step(closure, targets="abc")
    with pytest.raises(ValueError, match=r"single number.*shape \[10, 3\]"):
        opt.step(lambda: closure(swap=True))
    assert opt.num_steps == 0


def test_kfac_preconditioner_with_huge_lr_or_an_int_damping() -> None:
    """lr beyond 1.3e154 (lr² overflows a double) raised OverflowError in the KL clip, and lr²·Σvᵀg
    overflowing below it gave ν = 1 (no clip); an int damping beyond int64 raised in the factors'
    damping. The clipped step lr·ν does not depend on lr."""
    from torchsso2.kfac.kl_clip import kl_clip_scale
    v, g = torch.full((10,), 1e4, dtype=torch.float64), torch.full((10,), 1e4, dtype=torch.float64)  # Σ vᵀg = 1e9
    for lr in (1.0, 1e100, 1e150, 1e154, 1.4e154, 1e200):
        assert math.isclose(lr * kl_clip_scale([(v, g)], lr, 1e-3), 1e-6, rel_tol=1e-12), lr
    x, y = torch.randn(10, 4, dtype=torch.float64), torch.randint(0, 3, (10,))

    def grads(**kwargs) -> Tensor:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
        pre = KFACPreconditioner(m, **kwargs)
        m.zero_grad()
        F.cross_entropy(m(x), y).backward()
        pre.step()
        return torch.cat([p.grad.reshape(-1) for p in m.parameters()])

    big, ref = grads(lr=1e200) * 1e200, grads(lr=1e100) * 1e100
    assert bool(ref.ne(0).all())
    torch.testing.assert_close(big, ref, rtol=1e-10, atol=0.0)
    assert torch.equal(grads(damping=10 ** 30), grads(damping=1e30))


def test_more_bad_arguments_are_named() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    for skip in (False, 0):  # were taken as "no selection"
        with pytest.raises(TypeError, match="skip_modules must be a list"):
            curvature.compute(model, x, y, skip_modules=skip)
    with pytest.raises(TypeError, match="skip_modules entries.*int 1"):
        SecondOrderOptimizer(model, skip_modules=[1])
    for params, error, match in ((3.0, TypeError, "but got float"), ([1], TypeError, "holds int 1"),
                                 ([{"lr": 0.1}], ValueError, "required optimization parameter params")):
        with pytest.raises(error, match=match):
            SecondOrderOptimizer(model, params=params)
        with pytest.raises(error, match=match):
            VIOptimizer(model, dataset_size=10, params=params)
    opt = VIOptimizer(model, dataset_size=10)
    with pytest.raises(TypeError, match="generator must be a torch.Generator.*str 'abc'"):
        opt.predict(x, generator="abc")
    with pytest.raises(TypeError, match="generator must be a torch.Generator.*int 3"):
        with opt.sampled_params(generator=3):
            pass
    with pytest.raises(TypeError, match="return_variance must be a bool"):
        opt.predict(x, return_variance="no")


# ---- linear algebra at the edges of the dtype's range ----------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_backends_report_an_overflowing_result_and_symmetrize_without_overflow(backend: str) -> None:
    """A finite SPD float32 system whose solution overflows was [nan, inf] silently on the torch backend
    (the NumPy/CuPy one raised); a finite matrix near float32's max overflowed in a + aᵀ."""
    from curvature.linalg import LinalgError, get_backend
    lb = get_backend(backend)
    with pytest.raises(LinalgError, match="non-finite values"):
        lb.solve(1e-30 * torch.eye(2), torch.tensor([1e10, 1e10]))
    big = 2e38 * torch.eye(3)
    evals, _ = lb.eigh(big)
    torch.testing.assert_close(evals.double(), torch.full((3,), 2e38, dtype=torch.float64), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(lb.cholesky(big).diagonal().double(), torch.full((3,), 2e38 ** 0.5,
                                                                                  dtype=torch.float64), rtol=1e-6, atol=0.0)


def test_curvature_methods_name_a_vector_on_another_device() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    c = curvature.compute(model, torch.randn(10, 4), torch.randint(0, 3, (10,)), approx="kfac")
    for call in (lambda: c.matvec(torch.ones(c.numel, device="meta")),
                 lambda: c.solve(torch.ones(c.numel, device="meta"), 0.1),
                 lambda: c.matvec([torch.ones_like(p, device="meta") for p in c.params])):
        with pytest.raises(ValueError, match="the vector is on meta, the curvature on cpu"):
            call()


def test_vi_debias_after_a_failed_first_decomposition() -> None:
    """A first decomposition that fails (an indefinite Hessian, no posterior yet) is a skipped step: it
    advanced num_steps, so the first real update took lr/(1 − 0.9²) with one gradient in its buffer
    (0.53x the documented lr/(1 − 0.9))."""
    torch.manual_seed(0)
    x = torch.randn(16, 3, dtype=torch.float64)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    y_far = 10 * torch.randn(16, 1, dtype=torch.float64)  # large residuals: the Hessian is indefinite
    with torch.no_grad():
        y_fit = model(x).clone()  # zero residual: the Hessian is the Gauss-Newton
    lr, mom, delta, n = 0.01, 0.9, 1e-3, 50.0
    opt = VIOptimizer(model, dataset_size=50, lr=lr, momentum=mom, curvature="hessian", approx="full", loss="mse",
                      prior_precision=delta, curvature_init=None, ema_decay=0.0, kl_clip=None, momentum_debias=True)

    opt.step(make_closure(opt, model, x, y_far, "mse"), targets=y_far)
    assert (opt.num_steps, opt.num_skipped) == (0, 1)
    mu1 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    loss = 0.5 * (model(x) - y_fit).pow(2).sum(1).mean()
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, list(model.parameters()))])
    opt.step(make_closure(opt, model, x, y_fit, "mse"), targets=y_fit)
    mu2 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = mu1 - lr / (1 - mom) * n * torch.linalg.solve(opt.posterior_precision(), g + delta / n * mu1)
    torch.testing.assert_close(mu2, expected, rtol=1e-10, atol=1e-13)


def test_masked_logits_and_broadcast_queries_stay_supported() -> None:
    """-inf logits of masked classes are a finite loss (compute's non-finite check and the optimizer's
    skip take them); a Linear on learned queries [1, L, d] broadcast over the batch is no sequence-first
    layout under reduce."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double()
    mask = torch.tensor([False, False, True, False, True])
    masked = nn.Sequential(model, _Mask(mask))
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.tensor([0, 1, 3, 0, 1, 3, 3, 1])
    names = [n for n, _ in masked.named_parameters()]
    f, theta = _flat_fn(masked, names, (x,), lambda o: o.masked_fill(mask, -30.0))  # the same softmax to 1e-13
    c = curvature.compute(masked, x, y, kind="fisher", approx="full")
    assert _rel(c.dense(), _ggn(f, theta) * _block_mask([30, 35])) < 1e-10
    opt = SecondOrderOptimizer(masked, lr=0.1)

    for _ in range(3):
        opt.step(make_closure(opt, masked, x, y))
    assert (opt.num_steps, opt.num_skipped) == (3, 0)

    class Queries(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.q, self.head = nn.Embedding(V, 8), nn.Linear(8, 8), nn.Linear(8, C)
            self.register_buffer("lat", torch.randn(1, 3, 8))

        def forward(self, ids: Tensor) -> Tensor:
            h, q = self.emb(ids), self.q(self.lat)  # q: [1, 3, d]
            return self.head(h + torch.softmax(h @ q.transpose(1, 2), -1) @ q)

    ids, tgt = torch.randint(0, V, (4, 5)), torch.randint(0, C, (4, 5))
    curvature.compute(Queries(), ids, tgt, kind="fisher_mc", approx="kfac", kfac_approx="reduce")


class _Mask(nn.Module):
    def __init__(self, mask: Tensor) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, z: Tensor) -> Tensor:
        return z.masked_fill(self.mask, float("-inf"))


def test_deepcopy_of_a_detached_preconditioner_stays_detached() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    pre = KFACPreconditioner(model)
    pre.remove_hooks()
    model2, pre2 = copy.deepcopy((model, pre))
    assert not pre2._handles and all(not m._forward_hooks for m in model2.modules())


def test_kfac_solve_without_damping_takes_each_factors_rounding() -> None:
    """Two float32 factors of condition 1e3 each (1e6 for the product) were refused as singular at
    damping 0 (the rounding was measured against the product's spectrum); a singular factor still is."""
    from curvature.linalg import LinalgError
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(10, 10, bias=False))
    c = curvature.compute(m, torch.randn(64, 10), torch.randint(0, 10, (64,)), kind="fisher", approx="kfac")
    blk = c.blocks["0"]

    def spd(cond: float, seed: int, rank: int = 10) -> Tensor:
        q, _ = torch.linalg.qr(torch.randn(10, 10, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
        evals = torch.logspace(0, -math.log10(cond), 10, dtype=torch.float64)
        evals[rank:] = 0.0
        return (q * evals) @ q.T

    with torch.no_grad():
        blk.left.copy_(spd(1e3, 1).float())
        blk.right.copy_(spd(1e3, 2).float())
    v = torch.randn(100, dtype=torch.float64)
    ref = torch.linalg.solve(torch.kron(blk.left.double(), blk.right.double()), v)
    assert _rel(c.solve(v.float(), 0.0).double(), ref) < 1e-3
    with torch.no_grad():
        blk.right.copy_(spd(1e3, 2, rank=9).float())
    blk.decomposition = None
    with pytest.raises(LinalgError, match="singular"):
        c.solve(v.float(), 0.0)


def test_kfac_preconditioner_flags_and_loglevel_are_checked() -> None:
    pre = KFACPreconditioner(nn.Sequential(nn.Linear(2, 2)))
    for value, error in ((1.5, TypeError), (True, TypeError), (-1, ValueError)):  # the setter took any of them
        with pytest.raises(error, match="loglevel"):
            pre.loglevel = value
    pre.loglevel = 20
    assert pre.loglevel == 20
    with pytest.raises(TypeError, match=r"include_factors must be a bool \(or 0/1\), got str 'no'"):
        pre.state_dict(include_factors="no")
    with pytest.raises(TypeError, match="include_decompositions must be a bool"):
        pre.state_dict(include_decompositions=0.0)
    with pytest.raises(TypeError, match="compute_inverses must be a bool"):
        pre.load_state_dict(pre.state_dict(), compute_inverses="yes")
    # 0/1 are bools here as in the constructor (and kfac_pytorch): the same state as True/False
    assert pre.state_dict(include_factors=0, include_decompositions=1).keys() == \
        pre.state_dict(include_factors=False, include_decompositions=True).keys()
    assert "layers" not in pre.state_dict(include_factors=0)
    pre.load_state_dict(pre.state_dict(), 1)


def test_sso_failed_first_decomposition_is_a_skipped_step() -> None:
    """As VIOptimizer: no decomposition yet, nothing to precondition with: a skipped step that leaves
    num_steps (the schedules) where it was; the next step retries."""
    torch.manual_seed(0)
    x = torch.randn(16, 3, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    y_far = 10 * torch.randn(16, 1, dtype=torch.float64)  # an indefinite Hessian
    opt = SecondOrderOptimizer(model, curvature="hessian", approx="full", loss="mse", damping=1e-6, kl_clip=None,
                               curv_update_interval=2, inv_update_interval=2)

    before = [p.detach().clone() for p in model.parameters()]
    opt.step(make_closure(opt, model, x, y_far, "mse"), targets=y_far)
    assert (opt.num_steps, opt.num_skipped) == (0, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_singular_float32_factor_decomposed_in_float64_is_refused(method: str) -> None:
    """A float32 factor carries float32's rounding in a float64 decomposition: the exactly singular G of
    a cross-entropy head (G·1 = 0) was accepted with decomposition dtype float64 at damping 0 (a solve
    of 1e7)."""
    from curvature.linalg import LinalgError
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 3))
    c = curvature.compute(m, torch.randn(64, 6), torch.randint(0, 3, (64,)), kind="fisher", approx="kfac")
    blk = c.blocks["0"]
    assert float(torch.linalg.eigvalsh(blk.G.double()).min()) > 0  # positive by rounding: only the size test sees it
    for dtype in (None, torch.float64):
        with pytest.raises(LinalgError, match="singular"):
            blk.decompose(0.0, method=method, dtype=dtype)


def test_empirical_fisher_of_a_head_on_rows_is_per_sequence_whatever_the_other_blocks() -> None:
    """[N, T, C] logits from a head on the N·T rows: its diagonal block was the per-row empirical Fisher
    (0.27 off) when every other module was K-FAC or skipped, the per-sequence one otherwise."""
    n, t, d, c = 3, 4, 3, 5

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(d, d), nn.Linear(d, c)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(torch.tanh(self.body(x)).reshape(-1, d)).view(n, t, c)

    torch.manual_seed(1)
    m = M().double()
    x, y = torch.randn(n, t, d, dtype=torch.float64), torch.randint(0, c, (n, t))
    h = torch.tanh(m.body(x)).reshape(-1, d).detach()
    e = F.linear(h, m.head.weight, m.head.bias).softmax(-1).detach() - F.one_hot(y.reshape(-1), c)
    rows = torch.cat([(e[:, :, None] * h[:, None, :]).flatten(1), e], 1)
    per_sequence = (rows.view(n, t, -1).sum(1) ** 2).sum(0) / (n * t)
    for kwargs in ({"approx": {"head": "diag", "body": "kfac"}}, {"approx": "diag"},
                   {"approx": "diag", "skip_modules": ["body"]}):
        got = curvature.compute(m, x, y, kind="empirical_fisher", **kwargs).blocks["head"].diagonal
        torch.testing.assert_close(got, per_sequence, rtol=1e-12, atol=1e-15)


def test_vi_resumed_after_a_failed_first_decomposition_counts_as_the_uninterrupted_run() -> None:
    """A checkpoint saved after a failed first decomposition: the resumed step decomposed twice (a second
    skip counted, the streak one ahead); it now equals the uninterrupted run, counters included."""
    import io
    torch.manual_seed(0)
    batches = [torch.randn(32, 4) for _ in range(3)]
    targets = [torch.randn(32, 2) * 50] + [torch.zeros(32, 2) for _ in range(2)]

    def make(m: nn.Module) -> VIOptimizer:
        return VIOptimizer(m, dataset_size=64, lr=0.05, approx="full", curvature="hessian", loss="mse",
                           prior_precision=300.0, damping=0.0, curvature_init=None, seed=5, kl_clip=None, ema_decay=0.0)

    def run(resume: bool) -> Tuple[List[Tuple[int, int, int]], Tensor]:
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        opt, counts = make(m), []
        for i, (x, y) in enumerate(zip(batches, targets)):
            opt.step(make_closure(opt, m, x, y, "mse"), targets=y)
            if resume and i == 0:
                buf = io.BytesIO()
                torch.save({"m": m.state_dict(), "o": opt.state_dict()}, buf)
                buf.seek(0)
                saved = torch.load(buf, weights_only=True)
                m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
                m.load_state_dict(saved["m"])
                opt = make(m)
                opt.load_state_dict(saved["o"])
            counts.append((opt.num_steps, opt.num_skipped, opt._streak.count))
        return counts, torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    (c1, p1), (c2, p2) = run(False), run(True)
    assert c1[0] == (0, 1, 1) and c1 == c2
    assert torch.equal(p1, p2)
