"""Property-based checks (hypothesis): random Linear / Conv2d geometries and batch sizes.

For every drawn configuration the Fisher-type curvatures are symmetric positive semi-definite,
and on these small cases every kind × shape equals the brute-force reference.
"""
from __future__ import annotations

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


def _check(model, x, loss, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    y = torch.randint(0, 3, (n,), generator=gen) if loss == "cross_entropy" else \
        torch.randn(n, 3, generator=gen, dtype=torch.float64)
    ref = Reference(model, x, y, loss)
    for kind in KINDS:
        labels = sample_labels(loss, ref.outputs, 2, seed) if kind == "fisher_mc" else None
        for approx in ("full", "diag", "kfac"):
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
