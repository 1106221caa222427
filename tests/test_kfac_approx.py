"""``kfac_approx="expand" | "reduce"`` (Eschenhagen et al., NeurIPS 2023) for K-FAC blocks of Linear-like
layers applied over a weight-sharing dimension, at the cases where each is exact (brute-force GGN,
float64), plus the plumbing through the Curvature API and both optimizers."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

import curvature
from torchsso2 import SecondOrderOptimizer, VIOptimizer


class MeanPool(nn.Module):
    """``[N, T, d] → [N, d]``: the loss sees the sequence through a linear mean over positions."""

    def forward(self, h: Tensor) -> Tensor:
        return h.mean(dim=1)


def _ggn(model: nn.Module, x: Tensor, y: Tensor, loss: str) -> Tensor:
    """GGN of the engine's mean loss over the output rows, all parameters (float64 torch.func)."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def f(th: Tensor) -> Tensor:
        ps, i = {}, 0
        for n, s in zip(names, shapes):
            ps[n] = th[i:i + s.numel()].view(s)
            i += s.numel()
        return functional_call(model, ps, (x,))

    out = f(theta).detach()
    jac = jacrev(f)(theta).reshape(out.numel(), -1)

    def mean_loss(o: Tensor) -> Tensor:
        o = o.view(out.shape)
        if loss == "cross_entropy":
            return nn.functional.cross_entropy(o, y)
        return 0.5 * (o - y).pow(2).reshape(o.shape[0], -1).sum(1).mean()

    return jac.t() @ hessian(mean_loss)(out.reshape(-1)) @ jac


def _close(got: Tensor, want: Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10 * float(want.abs().max()))


def _pooled(n: int, t: int, d_in: int, d_out: int, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, d_out), MeanPool()).double()
    return model, torch.randn(n, t, d_in, dtype=torch.float64), torch.randn(n, d_out, dtype=torch.float64)


def _positionwise(n: int, t: int, d_in: int, d_out: int, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, d_out)).double()
    return model, torch.randn(n, t, d_in, dtype=torch.float64), torch.randn(n, t, d_out, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["fisher", "fisher_mc"])
def test_reduce_is_exact_behind_a_linear_mean_pool(kind: str) -> None:
    """Weight-shared Linear on ``[N, T, d]`` → mean over T → mse: every example's gradient is
    ``ĝ_n āᵀ`` with the same ``ĝ`` subspace (Λ = I), so K-FAC-reduce (A from the position-averaged
    inputs, G from the position-summed output gradients) is the GGN block; expand is not."""
    model, x, y = _pooled(3, 5, 4, 2)
    ref = _ggn(model, x, y, "mse")
    c = curvature.compute(model, x, y, loss="mse", kind="fisher", approx="kfac", kfac_approx="reduce")
    _close(c.dense(), ref)
    e = curvature.compute(model, x, y, loss="mse", kind="fisher", approx="kfac", kfac_approx="expand")
    assert float((e.dense() - ref).abs().max()) > 0.1 * float(ref.abs().max())
    if kind == "fisher_mc":  # the sampled Fisher approaches it (many samples)
        gen = torch.Generator().manual_seed(0)
        m = curvature.compute(model, x, y, loss="mse", kind=kind, approx="kfac", kfac_approx="reduce",
                              mc_samples=4000, generator=gen)
        assert float(torch.linalg.norm(m.dense() - ref) / torch.linalg.norm(ref)) < 0.1


def test_reduce_is_exact_for_one_sequence_behind_a_nonlinear_head() -> None:
    """One sequence (N = 1), mean pool then tanh and a cross-entropy head: the pooled Linear's
    per-example gradients are ``ĝ_k āᵀ`` for every vector k, so reduce is its exact GGN block."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 3), MeanPool(), nn.Tanh(), nn.Linear(3, 5)).double()
    x = torch.randn(1, 6, 4, dtype=torch.float64)
    y = torch.tensor([2])
    ref = _ggn(model, x, y, "cross_entropy")[:15, :15]  # the first Linear's weight and bias
    c = curvature.compute(model, x, y, kind="fisher", approx="kfac", kfac_approx="reduce")
    _close(c.blocks["0"].dense(), ref)


def test_expand_is_exact_for_a_positionwise_linear_with_mse() -> None:
    """One Linear applied at every position, mse over ``[N, T, D]`` (the example is the sequence):
    A = (1/(N·T)) Σ x xᵀ (with the bias's 1), G = T·I, and G ⊗ A is the GGN; reduce is not."""
    model, x, y = _positionwise(3, 5, 4, 2)
    ref = _ggn(model, x, y, "mse")
    c = curvature.compute(model, x, y, loss="mse", kind="fisher", approx="kfac", kfac_approx="expand")
    _close(c.dense(), ref)
    xa = torch.cat([x.reshape(-1, 4), torch.ones(15, 1, dtype=torch.float64)], 1)
    _close(c.blocks["0"].A, xa.t() @ xa / 15)
    _close(c.blocks["0"].G, 5 * torch.eye(2, dtype=torch.float64))
    r = curvature.compute(model, x, y, loss="mse", kind="fisher", approx="kfac", kfac_approx="reduce")
    assert float((r.dense() - ref).abs().max()) > 0.1 * float(ref.abs().max())


def test_reduce_on_sequence_logit_rows_and_attention() -> None:
    """Reduce on ``[N·T, C]`` rows: factors are the documented per-sequence reductions (A from the
    mean input, G from the summed output gradient, G divided by the N·T rows), for the MHA
    in-projection as for a Linear; Embedding stays expand."""
    torch.manual_seed(3)
    n, t, v, d, c = 2, 5, 7, 4, 3
    emb, attn, head = nn.Embedding(v, d), nn.MultiheadAttention(d, 2, batch_first=True), nn.Linear(d, c)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.attn, self.head = emb, attn, head

        def forward(self, idx: Tensor) -> Tensor:
            h = self.emb(idx)
            return self.head(h + self.attn(h, h, h, need_weights=False)[0])

    model = LM().double()
    x = torch.randint(0, v, (n, t))
    y = torch.randint(0, c, (n * t,))
    rows = lambda out: out.reshape(-1, c)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    red = curvature.compute(model, x, y, kind="empirical_fisher", approx="kfac", kfac_approx="reduce",
                            output_selector=rows, generator=gen)
    exp = curvature.compute(model, x, y, kind="empirical_fisher", approx="kfac", output_selector=rows)
    # head: output gradient at (n, t) is the row's own softmax − onehot; summed per sequence
    with torch.no_grad():
        h_in = model.emb(x) + model.attn(model.emb(x), model.emb(x), model.emb(x), need_weights=False)[0]
        e = (rows(model(x)).softmax(-1) - nn.functional.one_hot(y, c).double()).view(n, t, c)
    g_sum = e.sum(1)
    a_mean = torch.cat([h_in.mean(1), torch.ones(n, 1, dtype=torch.float64)], 1)
    _close(red.blocks["head"].G, g_sum.t() @ g_sum / (n * t))
    _close(red.blocks["head"].A, a_mean.t() @ a_mean / n)
    # the in-projection: A from the mean input (query = key = value = h) with the bias column
    with torch.no_grad():
        hm = torch.cat([model.emb(x).mean(1), torch.ones(n, 1, dtype=torch.float64)], 1)
    _close(red.blocks["attn"].A, hm.t() @ hm / n)
    assert not torch.allclose(red.blocks["attn"].G, exp.blocks["attn"].G)
    _close(red.blocks["emb"].G, exp.blocks["emb"].G)  # Embedding: expand either way
    _close(red.blocks["emb"].A, exp.blocks["emb"].A)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 4), t=st.integers(1, 5), d_in=st.integers(1, 4), d_out=st.integers(1, 3))
def test_expand_and_reduce_exact_cases_random_sizes(n: int, t: int, d_in: int, d_out: int) -> None:
    model, x, y = _positionwise(n, t, d_in, d_out)
    c = curvature.compute(model, x, y, loss="mse", kind="fisher", approx="kfac", kfac_approx="expand")
    _close(c.dense(), _ggn(model, x, y, "mse"))
    model, x, y = _pooled(n, t, d_in, d_out)
    c = curvature.compute(model, x, y, loss="mse", kind="fisher", approx="kfac", kfac_approx="reduce")
    _close(c.dense(), _ggn(model, x, y, "mse"))


def test_optimizers_take_kfac_approx() -> None:
    model, x, y = _pooled(3, 5, 4, 2)
    want = curvature.compute(model, x, y, loss="mse", kind="fisher", approx="kfac", kfac_approx="reduce")

    def closure_of(opt):
        def closure():
            opt.zero_grad()
            out = model(x)
            loss = 0.5 * (out - y).pow(2).sum(1).mean()
            loss.backward()
            return loss, out
        return closure

    sso = SecondOrderOptimizer(model, lr=0.0, curvature="fisher", loss="mse", kfac_approx="reduce", ema_decay=0.0)
    sso.step(closure_of(sso))
    assert sso.settings.kfac_approx == "reduce"
    _close(sso.running.blocks["0"].A, want.blocks["0"].A)
    _close(sso.running.blocks["0"].G, want.blocks["0"].G)
    vi = VIOptimizer(model, dataset_size=3, curvature="fisher_mc", approx="kfac", loss="mse", kfac_approx="reduce",
                     ema_decay=0.0, curvature_init=None)
    vi.step(closure_of(vi))
    assert vi.settings.kfac_approx == "reduce"
    _close(vi.running.blocks["0"].A, want.blocks["0"].A)  # the input side is the same under weight noise


@pytest.mark.parametrize("make", [
    lambda m: curvature.compute(m, torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64),
                                loss="mse", approx="kfac", kfac_approx="shrink"),
    lambda m: curvature.CurvatureEngine(m, kfac_approx="shrink"),
    lambda m: SecondOrderOptimizer(m, kfac_approx="shrink"),
    lambda m: VIOptimizer(m, dataset_size=10, kfac_approx="shrink"),
])
def test_bad_kfac_approx_is_a_value_error_naming_it(make) -> None:
    model, _, _ = _pooled(2, 3, 4, 2)
    with pytest.raises(ValueError, match=r"kfac_approx='shrink'.*'expand', 'reduce'"):
        make(model)


def test_reduce_is_exact_for_a_conv_behind_global_average_pooling() -> None:
    """Conv2d's patches are its weight-sharing positions: behind a global average pool and mse the
    per-example gradient is ``ĝ āᵀ`` (mean patch, summed output gradient), so reduce is the GGN block."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten()).double()
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    y = torch.randn(3, 3, dtype=torch.float64)
    ref = _ggn(model, x, y, "mse")
    c = curvature.compute(model, x, y, loss="mse", kind="fisher", approx="kfac", kfac_approx="reduce")
    _close(c.dense(), ref)
    e = curvature.compute(model, x, y, loss="mse", kind="fisher", approx="kfac")
    assert float((e.dense() - ref).abs().max()) > 0.1 * float(ref.abs().max())


class _SeqFirstLM(nn.Module):
    """Positions mixed along the first dimension of its Linear's output: a sequence-first layout."""

    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(11, 8)
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.e(t).transpose(0, 1)).cumsum(0)  # [T, N, d]
        return self.head(h).transpose(0, 1)  # [N, T, C]


@pytest.mark.parametrize("padding", [[4, 5, 5, 6], [4, 5, 5, 5]])  # 20 valid rows (divisible by N) and 19
def test_reduce_takes_a_padding_mask_and_still_refuses_a_sequence_first_layout(padding) -> None:
    """The layout check assumed rows // N consecutive loss rows per example whenever the masked row count
    was divisible by N, and refused a batch-first model with 'build it with batch_first=True'."""
    torch.manual_seed(0)
    lm = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 11))
    ids, nxt = torch.randint(1, 11, (4, 6)), torch.randint(1, 11, (4, 6))
    for i, valid in enumerate(padding):
        nxt[i, valid:] = 0
    mask = nxt != 0
    c = curvature.compute(lm, ids, nxt[mask], kind="fisher_mc", approx="kfac", kfac_approx="reduce",
                          output_selector=lambda out: out[mask])
    assert c.dense().shape == (419, 419)
    with pytest.raises(ValueError, match="whose first dimension is not the examples"):
        curvature.compute(_SeqFirstLM(), ids, nxt[mask], kind="fisher_mc", approx="kfac", kfac_approx="reduce",
                          output_selector=lambda out: out[mask])
