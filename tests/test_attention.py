"""Attention: ``nn.MultiheadAttention``'s projections and attention written with ``nn.Linear`` +
``F.scaled_dot_product_attention``, every kind × shape against the brute-force reference (float64).

``nn.MultiheadAttention`` gets two blocks: its in-projection (``in_proj_weight``/``in_proj_bias``, Q, K and
V rows in one Linear-like block) and ``out_proj``; during a recorded forward the module is recomputed from
its parameters (:mod:`curvature.modules.attention`). Its K-FAC blocks are those of the same model written
with two ``nn.Linear`` layers (expand convention over the positions), whose K-FAC the reference builds;
for cross-attention over the query, key and value positions one after the other.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import curvature
from curvature.capture import Capture
from curvature.engine import CurvatureEngine
from reference import Reference, sample_labels

N, T, E, H, C = 3, 4, 4, 2, 3
KINDS = ["fisher", "fisher_mc", "empirical_fisher", "hessian"]


class MHANet(nn.Module):
    """Linear → tanh → causal self-attention (nn.MultiheadAttention) → tanh → mean over T → Linear."""

    def __init__(self, batch_first: bool = True, padding: bool = False) -> None:
        super().__init__()
        self.batch_first, self.padding = batch_first, padding
        self.inp = nn.Linear(2, E)
        self.attn = nn.MultiheadAttention(E, H, batch_first=batch_first)
        self.fc = nn.Linear(E, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if not self.batch_first:
            h = h.transpose(0, 1)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)  # True: not allowed (MHA's convention)
        pad = None
        if self.padding:  # the last key of the first example is padding
            pad = torch.zeros(x.shape[0], T, dtype=torch.bool)
            pad[0, -1] = True
        o, _ = self.attn(h, h, h, attn_mask=mask, key_padding_mask=pad)
        if not self.batch_first:
            o = o.transpose(0, 1)
        return self.fc(torch.tanh(o).mean(1))


class SDPANet(nn.Module):
    """The same model with the attention written as ``nn.Linear`` + ``F.scaled_dot_product_attention``."""

    def __init__(self, math_backend: bool = False) -> None:
        super().__init__()
        self.math_backend = math_backend  # the only SDPA kernel with a differentiable backward on CPU
        self.inp = nn.Linear(2, E)
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)
        self.fc = nn.Linear(E, C)

    @classmethod
    def like(cls, mha: MHANet) -> "SDPANet":
        net = cls().double()
        with torch.no_grad():
            for dst, src in ((net.inp, mha.inp), (net.fc, mha.fc), (net.out, mha.attn.out_proj)):
                dst.weight.copy_(src.weight)
                dst.bias.copy_(src.bias)
            net.qkv.weight.copy_(mha.attn.in_proj_weight)
            net.qkv.bias.copy_(mha.attn.in_proj_bias)
        return net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        n = h.shape[0]
        q, k, v = (p.reshape(n, T, H, E // H).transpose(1, 2) for p in self.qkv(h).chunk(3, dim=-1))
        if self.math_backend:
            with sdpa_kernel(SDPBackend.MATH):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(n, T, E)
        return self.fc(torch.tanh(self.out(o)).mean(1))


def _batch(loss: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, T, 2, dtype=torch.float64, generator=gen)
    y = torch.randint(0, C, (N,), generator=gen) if loss == "cross_entropy" else \
        torch.randn(N, C, dtype=torch.float64, generator=gen)
    return x, y


def _kw(kind: str) -> dict:
    # the engine draws the reference's labels from an identically seeded generator
    return dict(mc_samples=2, generator=torch.Generator().manual_seed(3)) if kind == "fisher_mc" else {}


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = max(1.0, float(expected.abs().max()))
    assert float((got - expected).abs().max()) <= 1e-8 * scale


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("approx", ["full", "diag"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["batch_first", "seq_first", "padding"])
def test_multihead_attention_blocks_equal_brute_force(layout: str, kind: str, approx: str, loss: str) -> None:
    torch.manual_seed(0)
    model = MHANet(batch_first=layout != "seq_first", padding=layout == "padding").double()
    x, y = _batch(loss)
    ref = Reference(model, x, y, loss)
    c = curvature.compute(model, x, y, loss=loss, kind=kind, approx=approx, **_kw(kind))
    assert list(c.blocks) == ["inp", "attn", "attn.out_proj", "fc"]
    assert c.blocks["attn"].layout.param_names == ("in_proj_weight", "in_proj_bias")
    labels = sample_labels(loss, ref.outputs, 2, 3) if kind == "fisher_mc" else None
    _close(c.dense(), ref.shaped(kind, approx, labels))


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
@pytest.mark.parametrize("kind", KINDS)
def test_linear_sdpa_attention_blocks_equal_brute_force(kind: str, approx: str, loss: str) -> None:
    """Attention from ``nn.Linear`` + ``F.scaled_dot_product_attention`` on ``[N, T, d]``: K-FAC is the
    expand convention (``A`` over the N·T positions, ``G`` summed over positions ÷ N)."""
    if kind == "hessian" and approx == "kfac":
        pytest.skip("K-FAC of the Hessian is not implemented (NotImplementedError, tested elsewhere)")
    torch.manual_seed(0)
    model = SDPANet(math_backend=kind == "hessian").double()
    x, y = _batch(loss)
    ref = Reference(model, x, y, loss)
    labels = sample_labels(loss, ref.outputs, 2, 3) if kind == "fisher_mc" else None
    got = curvature.compute(model, x, y, loss=loss, kind=kind, approx=approx, **_kw(kind)).dense()
    _close(got, ref.shaped(kind, approx, labels))


@pytest.mark.parametrize("approx", ["full", "diag"])
def test_multihead_attention_blocks_from_the_users_backward(approx: str) -> None:
    """Empirical Fisher from the gradients recorded during the user's own backward (the optimizers'
    ``curvature='empirical_fisher'`` without targets): the in-projection's gradient is recorded on ``z``."""
    torch.manual_seed(0)
    model = MHANet(padding=True).double()
    x, y = _batch("cross_entropy")
    engine = CurvatureEngine(model, kind="empirical_fisher", approx=approx)
    with engine.capture(record_backward=True) as cap:
        F.cross_entropy(model(x), y).backward()
    got = torch.block_diag(*[b.dense() for b in engine.estimate_from_backward(cap).values()])
    _close(got, Reference(model, x, y, "cross_entropy").shaped("empirical_fisher", approx))


def test_hessian_through_a_kernel_without_second_derivative_is_a_clear_error() -> None:
    """CPU SDPA's default (flash) kernel has no double backward: the Hessian names the fix."""
    torch.manual_seed(0)
    x, y = _batch("cross_entropy")
    with pytest.raises(NotImplementedError, match="SDPBackend.MATH"):
        curvature.compute(SDPANet().double(), x, y, kind="hessian", approx="diag")


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("kind", ["fisher", "fisher_mc", "empirical_fisher"])
def test_multihead_attention_kfac_is_that_of_its_linear_projections(kind: str, loss: str) -> None:
    """K-FAC of MHA's in_proj and out_proj = the reference K-FAC of the same two projections as ``nn.Linear``."""
    torch.manual_seed(0)
    model = MHANet().double()
    x, y = _batch(loss)
    twin = SDPANet.like(model)
    assert torch.allclose(model(x), twin(x), rtol=0, atol=1e-14)
    labels = sample_labels(loss, Reference(model, x, y, loss).outputs, 2, 3) if kind == "fisher_mc" else None
    expected = Reference(twin, x, y, loss).shaped(kind, "kfac", labels)
    got = curvature.compute(model, x, y, loss=loss, kind=kind, approx="kfac", **_kw(kind))
    assert [type(b).__name__ for b in got.blocks.values()] == ["KFACBlock"] * 4
    _close(got.dense(), expected)


@pytest.mark.parametrize("call", [
    dict(batch_first=True, shape=(N, T, E), kw={}),
    dict(batch_first=False, shape=(T, N, E), kw=dict(average_attn_weights=False)),
    dict(batch_first=True, shape=(T, E), kw=dict(need_weights=False)),  # unbatched
    dict(batch_first=True, shape=(N, T, E), kw=dict(is_causal=True, attn_mask=torch.ones(T, T).triu(1).bool())),
    dict(batch_first=True, shape=(N, T, E),
         kw=dict(attn_mask=torch.randn(N * H, T, T, dtype=torch.float64),
                 key_padding_mask=torch.zeros(N, T, dtype=torch.float64).index_fill_(1, torch.tensor([T - 1]), -1e4))),
])
def test_recorded_forward_returns_what_the_module_returns(call: dict) -> None:
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(E, H, batch_first=call["batch_first"]).double()
    x = torch.randn(*call["shape"], dtype=torch.float64)
    want = attn(x, x, x, **call["kw"])
    with Capture({"attn": attn, "attn.out_proj": attn.out_proj}, record_backward=True) as cap:
        got = attn(x, x, x, **call["kw"])
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, rtol=0, atol=1e-12)
    rec = cap.records["attn"]
    assert rec.output.shape[-1] == 3 * E and rec.inputs[0].shape[-1] == E
    assert set(cap.records) == {"attn", "attn.out_proj"}
    got[0].sum().backward()
    assert rec.backward_grads and cap.records["attn.out_proj"].backward_grads


def test_recorded_in_projection_is_freed_with_the_capture() -> None:
    """The gradient hook on the recorded ``z`` must not hold the record (a cycle through autograd's C++
    graph that the garbage collector cannot break would keep every step's tensors alive)."""
    import gc
    import weakref

    attn = nn.MultiheadAttention(E, H, batch_first=True).double()
    x = torch.randn(N, T, E, dtype=torch.float64, requires_grad=True)
    with Capture({"attn": attn, "attn.out_proj": attn.out_proj}, record_backward=True) as cap:
        out, _ = attn(x, x, x)
    out.sum().backward()
    z = weakref.ref(cap.records["attn"].output)
    del cap, out
    gc.collect()
    assert z() is None


S = 3  # key/value positions of the cross-attention model


class CrossNet(nn.Module):
    """Query positions attend to S memory positions (key is value), both from one input ``[N, T + S, 2]``."""

    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(2, E)
        self.attn = nn.MultiheadAttention(E, H, batch_first=batch_first)
        self.fc = nn.Linear(E, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        q, mem = h[:, :T], h[:, T:]
        if not self.batch_first:
            q, mem = q.transpose(0, 1), mem.transpose(0, 1)
        pad = torch.zeros(x.shape[0], S, dtype=torch.bool)
        pad[0, -1] = True
        o, _ = self.attn(q, mem, mem, key_padding_mask=pad)
        if not self.batch_first:
            o = o.transpose(0, 1)
        return self.fc(torch.tanh(o).mean(1))


class CrossTwin(nn.Module):
    """:class:`CrossNet` with the in-projection as one ``nn.Linear`` on the query, key and value positions
    one after the other (the documented normal form) and out_proj as an ``nn.Linear``."""

    def __init__(self, net: CrossNet) -> None:
        super().__init__()
        self.inp, self.proj, self.out, self.fc = nn.Linear(2, E), nn.Linear(E, 3 * E), nn.Linear(E, E), nn.Linear(E, C)
        with torch.no_grad():
            for dst, w, b in ((self.inp, net.inp.weight, net.inp.bias), (self.fc, net.fc.weight, net.fc.bias),
                              (self.proj, net.attn.in_proj_weight, net.attn.in_proj_bias),
                              (self.out, net.attn.out_proj.weight, net.attn.out_proj.bias)):
                dst.weight.copy_(w)
                dst.bias.copy_(b)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        n = h.shape[0]
        q, mem = h[:, :T], h[:, T:]
        z = self.proj(torch.cat([q, mem, mem], dim=1))
        zq, zk, zv = z[:, :T, :E], z[:, T:T + S, E:2 * E], z[:, T + S:, 2 * E:]
        qh, kh, vh = (p.reshape(n, p.shape[1], H, E // H).transpose(1, 2) for p in (zq, zk, zv))
        scores = qh @ kh.transpose(-1, -2) / (E // H) ** 0.5
        pad = torch.zeros(n, S, dtype=torch.bool)
        pad[0, -1] = True
        scores = scores.masked_fill(pad.reshape(n, 1, 1, S), float("-inf"))
        o = (torch.softmax(scores, -1) @ vh).transpose(1, 2).reshape(n, T, E)
        return self.fc(torch.tanh(self.out(o)).mean(1))


def _cross_batch(loss: str):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, T + S, 2, dtype=torch.float64, generator=gen)
    y = torch.randint(0, C, (N,), generator=gen) if loss == "cross_entropy" else \
        torch.randn(N, C, dtype=torch.float64, generator=gen)
    return x, y


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("approx", ["full", "diag"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_cross_attention_blocks_equal_brute_force(batch_first: bool, kind: str, approx: str, loss: str) -> None:
    torch.manual_seed(0)
    model = CrossNet(batch_first).double()
    x, y = _cross_batch(loss)
    ref = Reference(model, x, y, loss)
    labels = sample_labels(loss, ref.outputs, 2, 3) if kind == "fisher_mc" else None
    c = curvature.compute(model, x, y, loss=loss, kind=kind, approx=approx, **_kw(kind))
    _close(c.dense(), ref.shaped(kind, approx, labels))


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("kind", ["fisher", "fisher_mc", "empirical_fisher"])
def test_cross_attention_kfac_is_expand_over_the_query_key_value_positions(kind: str, loss: str) -> None:
    torch.manual_seed(0)
    model = CrossNet().double()
    x, y = _cross_batch(loss)
    twin = CrossTwin(model)
    assert torch.allclose(model(x), twin(x), rtol=0, atol=1e-14)
    labels = sample_labels(loss, Reference(model, x, y, loss).outputs, 2, 3) if kind == "fisher_mc" else None
    expected = Reference(twin, x, y, loss).shaped(kind, "kfac", labels)
    _close(curvature.compute(model, x, y, loss=loss, kind=kind, approx="kfac", **_kw(kind)).dense(), expected)


def test_cross_attention_recorded_forward_returns_what_the_module_returns() -> None:
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(E, H).double()  # sequence-first
    q, k, v = (torch.randn(L, N, E, dtype=torch.float64) for L in (T, S, S))
    mask = torch.randn(T, S, dtype=torch.float64)
    want = attn(q, k, v, attn_mask=mask)
    with Capture({"attn": attn, "attn.out_proj": attn.out_proj}) as cap:
        got = attn(q, k, v, attn_mask=mask)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert cap.records["attn"].output.shape == (N, T + 2 * S, 3 * E)


def test_unsupported_attention_options_are_clear_errors() -> None:
    for kw in (dict(kdim=3, vdim=3), dict(add_bias_kv=True), dict(add_zero_attn=True)):
        model = nn.Sequential(nn.MultiheadAttention(E, H, batch_first=True, **kw))
        with pytest.raises(ValueError, match="skip_modules"):
            CurvatureEngine(model)


def test_optimizers_train_a_model_with_multihead_attention() -> None:
    from torchsso2 import SecondOrderOptimizer, VIOptimizer

    torch.manual_seed(0)
    x, y = _batch("cross_entropy")
    for make in (lambda m: SecondOrderOptimizer(m, lr=0.05),
                 lambda m: VIOptimizer(m, lr=0.05, dataset_size=N, approx="diag")):
        torch.manual_seed(0)
        model = MHANet().double()
        opt = make(model)
        losses = []
        for _ in range(10):
            def closure():
                opt.zero_grad()
                out = model(x)
                loss = F.cross_entropy(out, y)
                loss.backward()
                return loss, out
            losses.append(float(opt.step(closure)[0].detach()))
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


class _TransposedSelfAttention(nn.Module):
    """Self-attention on a sequence-first MultiheadAttention, the transpose taken once or once per argument."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(4, 4)
        self.att = nn.MultiheadAttention(4, 2)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        q = h.transpose(0, 1)
        kv = {"one": q, "twice": h.transpose(0, 1), "detached": q.detach()}[self.mode]
        return self.head(self.att(q, kv, kv, need_weights=False)[0].mean(0))  # [N, C]


@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher"])
def test_self_attention_on_the_same_view_taken_twice_is_self_attention(kind: str) -> None:
    """att(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1)) is self-attention as much as one
    transposed tensor passed three times: it was taken for cross-attention (tensor identity), whose
    K-FAC convention gave another in-projection block (10% off). A detached key/value is another
    function (no gradient path through them): not taken for self-attention, and its full blocks are
    the brute force's."""
    torch.manual_seed(0)
    x, y = torch.randn(3, 4, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
    one = _TransposedSelfAttention("one").double()
    twice = _TransposedSelfAttention("twice").double()
    twice.load_state_dict(one.state_dict())
    for approx in ("kfac", "full"):
        a, b = (curvature.compute(m, x, y, kind=kind, approx=approx) for m in (one, twice))
        for name in a.blocks:
            torch.testing.assert_close(a.blocks[name].dense(), b.blocks[name].dense(), rtol=1e-12, atol=1e-14)
    detached = _TransposedSelfAttention("detached").double()
    detached.load_state_dict(one.state_dict())
    c = curvature.compute(detached, x, y, kind=kind, approx="full")
    expected = Reference(detached, x, y, "cross_entropy").shaped(kind, "full", None)
    assert float((c.dense() - expected).abs().max()) <= 1e-8 * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("kind,approx", [(k, a) for k in KINDS for a in ("full", "diag", "kfac")
                                          if (k, a) != ("hessian", "kfac")])  # (not implemented)
def test_attention_with_a_frozen_in_projection_covers_out_proj(kind: str, approx: str) -> None:
    """Fine-tuning out_proj and the head only: nn.MultiheadAttention's forward never calls out_proj, and with no
    trainable in-projection nothing recomputed it, so every kind raised "covered modules were not called"."""
    torch.manual_seed(0)
    model = MHANet(batch_first=True, padding=False).double()
    model.attn.in_proj_weight.requires_grad_(False)
    model.attn.in_proj_bias.requires_grad_(False)
    x, y = _batch("cross_entropy")
    ref = Reference(model, x, y, "cross_entropy")
    c = curvature.compute(model, x, y, loss="cross_entropy", kind=kind, approx=approx, **_kw(kind))
    assert list(c.blocks) == ["inp", "attn.out_proj", "fc"]
    labels = sample_labels("cross_entropy", ref.outputs, 2, 3) if kind == "fisher_mc" else None
    if approx != "kfac":
        _close(c.dense(), ref.shaped(kind, approx, labels))
    # out_proj's block is the one it has with the in-projection trainable
    model.attn.in_proj_bias.requires_grad_(True)
    again = curvature.compute(model, x, y, loss="cross_entropy", kind=kind, approx=approx, **_kw(kind))
    _close(c.blocks["attn.out_proj"].dense(), again.blocks["attn.out_proj"].dense())
    # an out_proj replaced by a plain nn.Linear (the attention reads its weight and bias all the same)
    model.attn.in_proj_bias.requires_grad_(False)
    model.attn.out_proj = nn.Linear(model.attn.embed_dim, model.attn.embed_dim).double()
    replaced = curvature.compute(model, x, y, loss="cross_entropy", kind=kind, approx=approx, **_kw(kind))
    assert list(replaced.blocks) == ["inp", "attn.out_proj", "fc"]
