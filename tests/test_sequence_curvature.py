"""Exact and empirical Fisher blocks of sequence models (logits ``[N, T, C]`` reshaped to ``[N·T, C]``
loss rows), per covered family (Embedding, LayerNorm, nn.MultiheadAttention, Linear), against the
brute-force GGN / per-sequence empirical Fisher (torch.func, float64). See :mod:`curvature.sequence`.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

import curvature
from reference import covered
from torchsso2 import SecondOrderOptimizer

N, T, V, D, C = 3, 4, 6, 4, 3


class TinyLM(nn.Module):
    """Embedding → LayerNorm → causal self-attention (residual) → LayerNorm → MLP (residual) → head."""

    def __init__(self, out: int = C) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.ln1 = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, out)

    def embed(self, idx: Tensor) -> Tensor:
        return self.emb(idx)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.embed(idx)
        q = self.ln1(h)
        mask = torch.triu(torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool), 1)
        h = h + self.attn(q, q, q, attn_mask=mask, need_weights=False)[0]
        h = h + self.fc2(torch.tanh(self.fc1(self.ln2(h))))
        return self.head(h)  # [N, T, out]


def _setup(loss: str, seed: int = 0) -> Tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    model = TinyLM().double().eval()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        for ln in (model.ln1, model.ln2):
            ln.weight.add_(0.3 * torch.randn(D, dtype=torch.float64))
            ln.bias.add_(0.3 * torch.randn(D, dtype=torch.float64))
    x = torch.randint(0, V, (N, T))
    y = torch.randint(0, C, (N * T,)) if loss == "cross_entropy" else torch.randn(N * T, C, dtype=torch.float64)
    return model, x, y


def _rows(out: Tensor) -> Tensor:
    return out.reshape(-1, out.shape[-1])


def _row_losses(loss: str, rows: Tensor, y: Tensor) -> Tensor:
    if loss == "cross_entropy":
        return nn.functional.cross_entropy(rows, y, reduction="none")
    return 0.5 * (rows - y).pow(2).sum(-1)


class Brute:
    """The curvature of ``(1/R) Σ_r ℓ_r`` over the covered parameters (``reference.covered`` order)."""

    def __init__(self, model: nn.Module, x: Tensor, y: Tensor, loss: str, selector=_rows) -> None:
        self.model, self.x, self.y, self.loss, self.selector = model, x, y, loss, selector
        self.names, self.slices = covered(model)
        params = dict(model.named_parameters())
        self.shapes = [params[n].shape for n in self.names]
        self.theta = torch.cat([params[n].detach().reshape(-1) for n in self.names])

    def rows(self, theta: Tensor) -> Tensor:
        ps: Dict[str, Tensor] = {}
        i = 0
        for n, s in zip(self.names, self.shapes):
            ps[n] = theta[i:i + s.numel()].view(s)
            i += s.numel()
        return self.selector(functional_call(self.model, ps, (self.x,)))

    def ggn(self) -> Tensor:
        out = self.rows(self.theta).detach()
        jac = jacrev(self.rows)(self.theta).reshape(out.numel(), -1)
        h = hessian(lambda o: _row_losses(self.loss, o.view(out.shape), self.y).mean())(out.reshape(-1))
        return jac.t() @ h @ jac

    def empirical_fisher(self, per_example: int) -> Tensor:
        """``(1/R) Σ_n g_n g_nᵀ``, ``g_n`` the gradient of example n's summed row losses."""
        def sequence_losses(theta: Tensor) -> Tensor:
            return _row_losses(self.loss, self.rows(theta), self.y).view(-1, per_example).sum(1)
        g = jacrev(sequence_losses)(self.theta)  # [N, P]
        return g.t() @ g / self.y.shape[0]

    def blocks(self, dense: Tensor) -> List[Tuple[str, Tensor]]:
        return [(s.name, dense[s.start:s.stop, s.start:s.stop]) for s in self.slices]


def _check_blocks(c: curvature.Curvature, brute: Brute, ref: Tensor, approx: str) -> None:
    got = c.dense()
    assert got.shape == ref.shape
    for (name, want), (_, have) in zip(brute.blocks(ref), brute.blocks(got)):
        if approx == "diag":
            want = torch.diag(want.diagonal())
        torch.testing.assert_close(have, want, rtol=1e-8, atol=1e-8 * float(want.abs().max()), msg=name)


FAMILIES = ["emb", "ln1", "attn", "fc1", "head"]  # Embedding, LayerNorm, MultiheadAttention, Linear


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("approx", ["diag", "full"])
def test_exact_fisher_of_sequence_logits_equals_the_brute_force_ggn(loss: str, approx: str) -> None:
    model, x, y = _setup(loss)
    brute = Brute(model, x, y, loss)
    c = curvature.compute(model, x, y, loss=loss, kind="fisher", approx=approx, output_selector=_rows)
    assert set(FAMILIES) <= set(c.blocks)
    _check_blocks(c, brute, brute.ggn(), approx)


def test_exact_fisher_of_sequence_outputs_per_example_mse_already_per_sequence() -> None:
    """``mse`` on ``[N, T, D]`` outputs straight into the loss: one example is the sequence
    (``ℓ_n = ½‖y_n − f_n‖²`` over every position), K = T·D vectors; exact as well."""
    model, x, _ = _setup("mse")
    y = torch.randn(N, T, C, dtype=torch.float64)
    brute = Brute(model, x, y.reshape(-1, C), "mse")
    ref = brute.ggn() * T  # the loss (1/N) Σ_n Σ_t ℓ_nt is T times the mean over the N·T rows
    for approx in ("diag", "full"):
        c = curvature.compute(model, x, y, loss="mse", kind="fisher", approx=approx)
        _check_blocks(c, brute, ref, approx)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("approx", ["diag", "full"])
def test_empirical_fisher_is_the_per_sequence_gradient_outer_product(loss: str, approx: str) -> None:
    model, x, y = _setup(loss)
    brute = Brute(model, x, y, loss)
    ref = brute.empirical_fisher(T)
    c = curvature.compute(model, x, y, loss=loss, kind="empirical_fisher", approx=approx, output_selector=_rows)
    _check_blocks(c, brute, ref, approx)
    # not the per-row definition (1/R) Σ_r ∇ℓ_r ∇ℓ_rᵀ: the cross terms of a sequence's rows count
    rows = jacrev(lambda th: _row_losses(loss, brute.rows(th), y))(brute.theta)
    per_row = rows.t() @ rows / y.shape[0]
    assert float((per_row.diagonal() - ref.diagonal()).abs().max()) > 1e-3 * float(ref.diagonal().abs().max())


def _check_users_backward_empirical_fisher(**optimizer_kwargs) -> None:
    """SecondOrderOptimizer's diagonal empirical Fisher from the user's backward of the mean token
    loss equals the brute-force per-sequence definition."""
    model, x, y = _setup("cross_entropy")
    brute = Brute(model, x, y, "cross_entropy")
    ref = brute.empirical_fisher(T)
    opt = SecondOrderOptimizer(model, lr=0.0, curvature="empirical_fisher", approx="diag", **optimizer_kwargs)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(_rows(out), y)
        loss.backward()
        return loss, out

    opt.step(closure)
    for s in brute.slices:
        want = ref[s.start:s.stop, s.start:s.stop].diagonal()
        torch.testing.assert_close(opt.running.blocks[s.name].diagonal, want, rtol=1e-8,
                                   atol=1e-8 * float(want.abs().max()), msg=s.name)


def test_empirical_fisher_from_the_users_backward_is_per_sequence() -> None:
    """The optimizer's empirical Fisher without targets (blocks from the user's own backward of the
    mean token loss) equals the per-sequence definition."""
    _check_users_backward_empirical_fisher(output_selector=_rows)


def test_exact_fisher_kfac_of_sequence_logits_has_no_cross_row_terms() -> None:
    """K-FAC of the exact Fisher backpropagates per position too: ``G`` of a Linear before the
    attention is ``(1/R) Σ_{n,t'} J_nt'ᵀ Λ_n J_nt'`` with the block-diagonal ``Λ_n`` of the rows'
    Hessians (brute force through a zero probe on the Linear's output)."""
    model, x, y = _setup("cross_entropy")
    fc = model.fc1
    c = curvature.compute(model, x, y, kind="fisher", approx="kfac", output_selector=_rows,
                          skip_modules=["attn"])
    holder: Dict[str, Tensor] = {}
    handle = fc.register_forward_hook(lambda m, i, o: o + holder["probe"])
    try:
        def rows_of(probe: Tensor) -> Tensor:
            holder["probe"] = probe
            return _rows(model(x))
        probe = torch.zeros(N, T, 2 * D, dtype=torch.float64)
        out = rows_of(probe).detach()
        jac = jacrev(rows_of)(probe).reshape(out.numel(), N * T, 2 * D)  # [R·C, N·T, d]
    finally:
        handle.remove()
    h = hessian(lambda o: _row_losses("cross_entropy", o.view(out.shape), y).sum())(out.reshape(-1))
    want = sum(jac[:, j].t() @ h @ jac[:, j] for j in range(N * T)) / (N * T)
    torch.testing.assert_close(c.blocks["fc1"].G, want, rtol=1e-8, atol=1e-12)
    # summing the factor's vectors over a sequence's rows (one vector per k, as before per-position
    # vectors) puts cross terms between rows into Λ_n: measurably different here
    from curvature.likelihoods import sqrt_output_hessian
    from curvature.options import LossType
    s = sqrt_output_hessian(LossType.CROSS_ENTROPY, out)  # [K, R, C]
    summed = s.reshape(-1, N, T, C).sum(2, keepdim=True).expand(-1, N, T, C)  # Σ_t s_ntk at every row of n
    lam = sum(torch.block_diag(*[v[n].reshape(-1).outer(v[n].reshape(-1)) for n in range(N)]) for v in summed)
    old = sum(jac[:, j].t() @ lam @ jac[:, j] for j in range(N * T)) / (N * T)
    assert float((old - want).abs().max()) > 1e-2 * float(want.abs().max())


def test_rows_that_are_not_example_major_are_refused() -> None:
    """Position-major rows (``out.transpose(0, 1).reshape(-1, C)``): the first T rows belong to
    several sequences, and per-position vectors would be wrong: ValueError."""
    model, x, y = _setup("cross_entropy")
    with pytest.raises(ValueError, match="example-major"):
        curvature.compute(model, x, y, kind="fisher", approx="diag",
                          output_selector=lambda out: out.transpose(0, 1).reshape(-1, C))


def test_a_module_without_the_batch_dimension_is_named() -> None:
    """A position embedding on ``torch.arange(T)`` (output ``[T, d]`` broadcast over the batch) has
    no per-example gradients: ValueError naming it and the fix; on the expanded positions it works."""
    class PosLM(TinyLM):
        def __init__(self, expand: bool) -> None:
            super().__init__()
            self.pos, self.expand = nn.Embedding(T, D), expand

        def embed(self, idx: Tensor) -> Tensor:
            pos = torch.arange(idx.shape[1])
            return self.emb(idx) + self.pos(pos.expand_as(idx) if self.expand else pos)

    torch.manual_seed(0)
    x, y = torch.randint(0, V, (N, T)), torch.randint(0, C, (N * T,))
    with pytest.raises(ValueError, match=r"\{'pos': 4\}.*expand\(N, T\)"):
        curvature.compute(PosLM(False).double(), x, y, kind="fisher", approx="diag", output_selector=_rows)
    model = PosLM(True).double()
    c = curvature.compute(model, x, y, kind="fisher", approx="diag", output_selector=_rows)
    brute = Brute(model, x, y, "cross_entropy")
    _check_blocks(c, brute, brute.ggn(), "diag")


def test_module_batches_that_do_not_divide_the_rows_are_refused() -> None:
    model, x, y = _setup("cross_entropy")
    with pytest.raises(ValueError, match="N dividing the rows"):
        curvature.compute(model, x, y[:-1], kind="fisher", approx="diag",
                          output_selector=lambda out: _rows(out)[:-1])


# ---- logits [N, T, C] straight into the loss (targets [N, T]): the same N·T rows -------------------
@pytest.mark.parametrize("kind", ["fisher", "fisher_mc", "empirical_fisher", "hessian"])
@pytest.mark.parametrize("approx", ["diag", "kfac"])
def test_sequence_logits_without_reshaping_are_the_rows(kind: str, approx: str) -> None:
    model, x, y = _setup("cross_entropy")
    if kind == "hessian" and approx == "kfac":
        pytest.skip("K-FAC of the Hessian is not implemented")
    blocks = []
    for out_sel, targets in ((_rows, y), (None, y.view(N, T))):
        gen = torch.Generator().manual_seed(0)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            c = curvature.compute(model, x, targets, kind=kind, approx=approx, output_selector=out_sel,
                                  generator=gen, skip_modules=["attn"] if kind == "hessian" else None)
        blocks.append(c)
    for name in blocks[0].blocks:
        for a, b in zip(blocks[0].blocks[name].tensors(), blocks[1].blocks[name].tensors()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    if kind == "fisher" and approx == "diag":
        brute = Brute(model, x, y, "cross_entropy")
        _check_blocks(blocks[1], brute, brute.ggn(), "diag")


def test_sequence_logits_in_the_optimizer_from_the_users_backward() -> None:
    """Empirical Fisher from the user's backward of ``F.cross_entropy`` over every token of
    ``[N, T, C]`` logits: the per-sequence definition, normalized by the N·T rows."""
    _check_users_backward_empirical_fisher()  # [N, T, C] logits straight into the optimizer


def test_sequence_logits_need_targets_of_their_shape_without_the_classes() -> None:
    model, x, y = _setup("cross_entropy")
    with pytest.raises(ValueError, match=r"targets of shape \[N, T\].*\(3, 4\).*got \(12,\)"):
        curvature.compute(model, x, y, kind="empirical_fisher", approx="diag")


# ---- random sizes (hypothesis) ------------------------------------------------------------------
class SizedLM(nn.Module):
    """Embedding → LayerNorm → causal self-attention (residual) → Linear head, any sizes."""

    def __init__(self, v: int, d: int, c: int) -> None:
        super().__init__()
        self.emb, self.ln = nn.Embedding(v, d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 1, batch_first=True)
        self.head = nn.Linear(d, c)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        q = self.ln(h)
        mask = torch.triu(torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool), 1)
        return self.head(h + self.attn(q, q, q, attn_mask=mask, need_weights=False)[0])


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 3), t=st.integers(1, 4), d=st.integers(2, 4), c=st.integers(2, 4),
       loss=st.sampled_from(["cross_entropy", "mse"]), kind=st.sampled_from(["fisher", "empirical_fisher"]),
       approx=st.sampled_from(["diag", "full"]), seed=st.integers(0, 2 ** 16))
def test_sequence_blocks_random_sizes(n: int, t: int, d: int, c: int, loss: str, kind: str, approx: str,
                                      seed: int) -> None:
    torch.manual_seed(seed)
    model = SizedLM(5, d, c).double().eval()
    x = torch.randint(0, 5, (n, t))
    y = torch.randint(0, c, (n * t,)) if loss == "cross_entropy" else torch.randn(n * t, c, dtype=torch.float64)
    brute = Brute(model, x, y, loss)
    ref = brute.ggn() if kind == "fisher" else brute.empirical_fisher(t)
    got = curvature.compute(model, x, y, loss=loss, kind=kind, approx=approx, output_selector=_rows)
    _check_blocks(got, brute, ref, approx)
    for _, blk in brute.blocks(got.dense()):  # PSD
        assert float(torch.linalg.eigvalsh(blk).min()) > -1e-10 * max(1.0, float(blk.abs().max()))


@pytest.mark.parametrize("module", ["fc1", "ln2", "emb"])
@pytest.mark.parametrize("approx", ["diag", "full"])
def test_position_local_blocks_skip_the_sum_over_positions(module: str, approx: str) -> None:
    """For per-position vectors whose gradient at a module is zero off their own position,
    :func:`curvature.sequence.localized` makes every (vector, example) one example of one position;
    the block is the same as from the ``[k, N, T, d]`` gradients. One gradient entry off position
    (what attention before the module's output would leave) makes it decline."""
    from curvature.engine import CurvatureEngine
    from curvature.options import Approx
    from curvature.sequence import localized

    model, x, _ = _setup("cross_entropy")
    eng = CurvatureEngine(model, kind="fisher", approx=approx)
    lay = eng.layouts[module]
    with eng.capture() as cap:
        model(x)
    rec = cap.records[module]
    a = lay.family.normal_input(lay.module, rec.inputs, rec.output)
    k = 5
    positions = torch.tensor([0, 3, 1, 3, 2])
    g = torch.zeros((k,) + tuple(rec.output.shape), dtype=torch.float64)
    for j, t in enumerate(positions.tolist()):
        g[j, :, t] = torch.randn(g.shape[1:2] + g.shape[3:], dtype=torch.float64)
    g = lay.family.normal_output_grad(lay.module, g)
    local = localized(a, g, positions)
    assert local is not None and local[0].shape[:2] == (k * N, 1)
    shape = Approx(approx)
    torch.testing.assert_close(eng._per_example_sum(lay, shape, *local), eng._per_example_sum(lay, shape, a, g),
                               rtol=1e-12, atol=1e-14)
    g[0, 0, 2, 0] = 1e-3
    assert localized(a, g, positions) is None
