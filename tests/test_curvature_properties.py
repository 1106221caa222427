"""Property-based checks (hypothesis): random Linear / Conv2d geometries and batch sizes.

For every drawn configuration the Fisher-type curvatures are symmetric positive semi-definite,
and on these small cases every kind × shape equals the brute-force reference.
"""
from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import curvature
from reference import Reference, sample_labels

SETTINGS = dict(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
KINDS = ["fisher", "fisher_mc", "empirical_fisher", "hessian"]


class ConvNet(nn.Module):
    def __init__(self, c_in, c_out, k, stride, padding, dilation, bias, hw) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, k, stride=stride, padding=padding, dilation=dilation, bias=bias)
        with torch.no_grad():
            out = self.conv(torch.zeros(1, c_in, hw, hw)).numel()
        self.fc = nn.Linear(out, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class LinearNet(nn.Module):
    def __init__(self, d_in, hidden, bias) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, 3, bias=not bias)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


@st.composite
def conv_configs(draw):
    k = draw(st.integers(1, 3))
    dilation = draw(st.integers(1, 2))
    padding = draw(st.integers(0, 2))
    stride = draw(st.integers(1, 3))
    span = dilation * (k - 1) + 1
    hw = draw(st.integers(max(span - 2 * padding, 1), 6))
    return dict(c_in=draw(st.integers(1, 2)), c_out=draw(st.integers(1, 3)), k=k, stride=stride,
                padding=padding, dilation=dilation, bias=draw(st.booleans()), hw=hw)


def _check(model, x, loss, seed, classes: int = 3, approxes=("full", "diag", "kfac")) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    y = torch.randint(0, classes, (n,), generator=gen) if loss == "cross_entropy" else \
        torch.randn(n, classes, generator=gen, dtype=torch.float64)
    ref = Reference(model, x, y, loss)
    for kind in KINDS:
        labels = sample_labels(loss, ref.outputs, 2, seed) if kind == "fisher_mc" else None
        for approx in approxes:
            if kind == "hessian" and approx == "kfac":
                continue
            # a fresh, identically seeded generator per call: the engine draws the reference's labels
            kw = dict(mc_samples=2, generator=torch.Generator().manual_seed(seed)) if kind == "fisher_mc" else {}
            d = curvature.compute(model, x, y, loss=loss, kind=kind, approx=approx, **kw).dense()
            expected = ref.shaped(kind, approx, labels)
            scale = max(1.0, float(expected.abs().max()))
            assert float((d - expected).abs().max()) <= 1e-8 * scale, (kind, approx)
            assert torch.equal(d, d.t()) or float((d - d.t()).abs().max()) <= 1e-12 * scale
            if kind != "hessian":
                assert float(torch.linalg.eigvalsh(d).min()) >= -1e-10 * scale, (kind, approx)


@settings(**SETTINGS)
@given(cfg=conv_configs(), n=st.integers(1, 4), loss=st.sampled_from(["cross_entropy", "mse"]),
       seed=st.integers(0, 2**16))
def test_conv2d_random_geometry(cfg, n, loss, seed) -> None:
    torch.manual_seed(seed)
    model = ConvNet(**cfg).double()
    x = torch.randn(n, cfg["c_in"], cfg["hw"], cfg["hw"], dtype=torch.float64)
    _check(model, x, loss, seed)


@settings(**SETTINGS)
@given(d_in=st.integers(1, 5), hidden=st.integers(1, 5), bias=st.booleans(), n=st.integers(1, 6),
       loss=st.sampled_from(["cross_entropy", "mse"]), seed=st.integers(0, 2**16))
def test_linear_random_sizes(d_in, hidden, bias, n, loss, seed) -> None:
    torch.manual_seed(seed)
    model = LinearNet(d_in, hidden, bias).double()
    x = torch.randn(n, d_in, dtype=torch.float64)
    _check(model, x, loss, seed)


# ---- tied weights and nn.MultiheadAttention -------------------------------------------------------------
# full/diag against the reference directly; K-FAC (the reference builds it per nn.Linear/Embedding) against the
# reference K-FAC of an untied copy (tied: (Σ L_u) ⊗ (Σ R_u) / U, curvature.tied) or of the same projections as
# nn.Linear layers (attention)
class TiedNet(nn.Module):
    """Embedding whose weight is also the output Linear's (``head.weight = emb.weight``)."""

    def __init__(self, vocab, dim, head_bias) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lin = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=head_bias)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.lin(self.emb(x))).mean(1))


class AttentionNet(nn.Module):
    """Linear → causal nn.MultiheadAttention → mean over positions → Linear."""

    def __init__(self, heads, head_dim, batch_first) -> None:
        super().__init__()
        e = heads * head_dim
        self.batch_first = batch_first
        self.inp = nn.Linear(2, e)
        self.attn = nn.MultiheadAttention(e, heads, batch_first=batch_first)
        self.fc = nn.Linear(e, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        t = h.shape[1]
        if not self.batch_first:
            h = h.transpose(0, 1)
        o, _ = self.attn(h, h, h, attn_mask=torch.ones(t, t, dtype=torch.bool).triu(1))
        if not self.batch_first:
            o = o.transpose(0, 1)
        return self.fc(torch.tanh(o).mean(1))


@settings(**SETTINGS)
@given(vocab=st.integers(3, 6), dim=st.integers(1, 4), head_bias=st.booleans(), t=st.integers(1, 4),
       n=st.integers(1, 5), loss=st.sampled_from(["cross_entropy", "mse"]), seed=st.integers(0, 2**16))
def test_tied_embedding_random_sizes(vocab, dim, head_bias, t, n, loss, seed) -> None:
    torch.manual_seed(seed)
    model = TiedNet(vocab, dim, head_bias).double()
    x = torch.randint(0, vocab, (n, t))
    _check(model, x, loss, seed, classes=vocab, approxes=("full", "diag"))
    untied = copy.deepcopy(model)
    untied.head.weight = nn.Parameter(model.emb.weight.detach().clone())
    y = torch.randint(0, vocab, (n,)) if loss == "cross_entropy" else torch.randn(n, vocab, dtype=torch.float64)
    ref = Reference(untied, x, y, loss)
    for kind in KINDS[:3]:
        labels = sample_labels(loss, ref.outputs, 2, seed) if kind == "fisher_mc" else None
        got = curvature.compute(model, x, y, loss=loss, kind=kind, approx="kfac", **_mc(kind, seed)).blocks["emb"]
        a_emb, g_emb, _ = ref.kfac("emb", kind, labels)
        a_head, g_head, _ = ref.kfac("head", kind, labels)
        if head_bias:  # the reference's head A has the bias row/column last; the tied weight has none
            a_head = a_head[:-1, :-1]
        expected = torch.kron(torch.diag(a_emb) + g_head, (g_emb + a_head) / 2)
        assert float((got.dense() - expected).abs().max()) <= 1e-8 * max(1.0, float(expected.abs().max())), kind


@settings(**SETTINGS)
@given(heads=st.integers(1, 2), head_dim=st.integers(1, 3), batch_first=st.booleans(), t=st.integers(1, 4),
       n=st.integers(1, 4), loss=st.sampled_from(["cross_entropy", "mse"]), seed=st.integers(0, 2**16))
def test_multihead_attention_random_sizes(heads, head_dim, batch_first, t, n, loss, seed) -> None:
    torch.manual_seed(seed)
    model = AttentionNet(heads, head_dim, batch_first).double()
    x = torch.randn(n, t, 2, dtype=torch.float64)
    _check(model, x, loss, seed, approxes=("full", "diag"))
    twin = LinearAttentionNet.like(model)
    y = torch.randint(0, 3, (n,)) if loss == "cross_entropy" else torch.randn(n, 3, dtype=torch.float64)
    ref = Reference(twin, x, y, loss)
    for kind in KINDS[:3]:
        labels = sample_labels(loss, ref.outputs, 2, seed) if kind == "fisher_mc" else None
        got = curvature.compute(model, x, y, loss=loss, kind=kind, approx="kfac", **_mc(kind, seed)).dense()
        expected = ref.shaped(kind, "kfac", labels)
        assert float((got - expected).abs().max()) <= 1e-8 * max(1.0, float(expected.abs().max())), kind


def _mc(kind, seed) -> dict:
    return dict(mc_samples=2, generator=torch.Generator().manual_seed(seed)) if kind == "fisher_mc" else {}


class LinearAttentionNet(nn.Module):
    """:class:`AttentionNet` with its in-projection and out_proj as plain ``nn.Linear`` layers."""

    def __init__(self, heads, e) -> None:
        super().__init__()
        self.heads = heads
        self.inp, self.qkv, self.out, self.fc = nn.Linear(2, e), nn.Linear(e, 3 * e), nn.Linear(e, e), nn.Linear(e, 3)

    @classmethod
    def like(cls, net: AttentionNet) -> "LinearAttentionNet":
        twin = cls(net.attn.num_heads, net.attn.embed_dim).double()
        with torch.no_grad():
            for dst, w, b in ((twin.inp, net.inp.weight, net.inp.bias), (twin.fc, net.fc.weight, net.fc.bias),
                              (twin.qkv, net.attn.in_proj_weight, net.attn.in_proj_bias),
                              (twin.out, net.attn.out_proj.weight, net.attn.out_proj.bias)):
                dst.weight.copy_(w)
                dst.bias.copy_(b)
        return twin

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        n, t, e = h.shape
        q, k, v = (p.reshape(n, t, self.heads, -1).transpose(1, 2) for p in self.qkv(h).chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2)) / (e // self.heads) ** 0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(n, t, e)
        return self.fc(torch.tanh(self.out(o)).mean(1))
