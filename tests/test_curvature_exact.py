"""Exact cases: identities that hold in closed form, checked without the engine's own code paths.

* one example: K-FAC of a Fisher-type matrix equals the full block (Linear ± bias, Conv1d/Conv2d with
  one output position, Embedding with T = 1);
* linear-Gaussian model: Fisher = GGN = Hessian = ``kron(I_out, X̃ᵀX̃/N)`` (weight row-major,
  bias as the last input column) and K-FAC is exact (``G = I``, ``A = X̃ᵀX̃/N``); the empirical
  Fisher differs;
* linear softmax model: Fisher = ``(1/N) Σ (diag p − p pᵀ) ⊗ x̃ x̃ᵀ`` in closed form;
* ``fisher_mc`` converges to ``fisher`` as ``mc_samples`` grows;
* the Hessian differs from the GGN for a tanh network (so the suite really distinguishes them),
  but equals it on the last (linear-in-parameters) layer.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature
from reference import Reference, sample_labels

FISHER_KINDS = ["fisher", "fisher_mc", "empirical_fisher"]
LOSSES = ["cross_entropy", "mse", "binary_cross_entropy"]


def _kw(kind: str) -> dict:
    return {"mc_samples": 2, "generator": torch.Generator().manual_seed(3)} if kind == "fisher_mc" else {}


def _labels(ref: Reference, kind: str):
    return sample_labels(ref.loss, ref.outputs, 2, 3) if kind == "fisher_mc" else None


def _targets(n: int, loss: str, gen: torch.Generator, out: int = 3) -> torch.Tensor:
    if loss == "cross_entropy":
        return torch.randint(0, out, (n,), generator=gen)
    if loss == "binary_cross_entropy":
        return torch.randint(0, 2, (n, out), generator=gen).double()
    return torch.randn(n, out, generator=gen, dtype=torch.float64)


class LinearHead(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3, bias=bias)
        self.fc2 = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class ConvOnePosition(nn.Module):
    """A Conv2d (or Conv1d, ``conv``) whose output has a single position (5×5 / length-5 input, kernel 3,
    dilation 2)."""

    def __init__(self, bias: bool, conv: type = nn.Conv2d) -> None:
        super().__init__()
        self.conv = conv(2, 3, kernel_size=3, dilation=2, bias=bias)
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class EmbeddingOneToken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3, padding_idx=0)
        self.fc = nn.Linear(3, 3)

    def forward(self, tok):
        return self.fc(torch.tanh(self.emb(tok)[:, 0]))


ONE_EXAMPLE = {
    "linear_bias": (lambda: LinearHead(True), "fc1", (4,)),
    "linear_nobias": (lambda: LinearHead(False), "fc1", (4,)),
    "conv_bias": (lambda: ConvOnePosition(True), "conv", (2, 5, 5)),
    "conv_nobias": (lambda: ConvOnePosition(False), "conv", (2, 5, 5)),
    "conv1d_bias": (lambda: ConvOnePosition(True, nn.Conv1d), "conv", (2, 5)),
    "conv1d_nobias": (lambda: ConvOnePosition(False, nn.Conv1d), "conv", (2, 5)),
    "embedding": (EmbeddingOneToken, "emb", None),
}


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("kind", FISHER_KINDS)
@pytest.mark.parametrize("case", list(ONE_EXAMPLE))
def test_one_example_kfac_equals_full_block(case: str, kind: str, loss: str) -> None:
    build, name, shape = ONE_EXAMPLE[case]
    torch.manual_seed(0)
    model = build().double().eval()
    gen = torch.Generator().manual_seed(11)
    x = torch.tensor([[3]]) if shape is None else torch.randn((1,) + shape, generator=gen, dtype=torch.float64)
    y = _targets(1, loss, gen)
    ref = Reference(model, x, y, loss)
    s = next(s for s in ref.slices if s.name == name)
    full_ref = ref.dense(kind, _labels(ref, kind))[s.start:s.stop, s.start:s.stop]
    kfac = curvature.compute(model, x, y, loss=loss, kind=kind, approx="kfac", **_kw(kind)).blocks[name]
    assert isinstance(kfac, curvature.KFACBlock)
    assert full_ref.abs().max() > 1e-3
    torch.testing.assert_close(kfac.dense(), full_ref, rtol=0, atol=1e-10)
    # the independent reference factors agree as well (validates the reference's K-FAC)
    torch.testing.assert_close(ref.kfac(name, kind, _labels(ref, kind))[2], full_ref, rtol=0, atol=1e-10)


def test_one_example_kfac_is_not_full_for_two_examples() -> None:
    """The identity above is specific to one example: with two, K-FAC is an approximation."""
    build, name, shape = ONE_EXAMPLE["linear_bias"]
    torch.manual_seed(0)
    model = build().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    y = torch.tensor([0, 2])
    c_k = curvature.compute(model, x, y, kind="fisher", approx="kfac").blocks[name].dense()
    ref = Reference(model, x, y, "cross_entropy")
    s = next(s for s in ref.slices if s.name == name)
    assert (c_k - ref.dense("fisher")[s.start:s.stop, s.start:s.stop]).abs().max() > 1e-4


# ---- linear models: closed forms -----------------------------------------------------------------
def _linear_data(n: int = 7, d: int = 3, out: int = 2, bias: bool = True):
    torch.manual_seed(1)
    model = nn.Linear(d, out, bias=bias).double()
    x = torch.randn(n, d, dtype=torch.float64)
    xt = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1) if bias else x
    return model, x, xt


def _to_param_order(m: torch.Tensor, out: int, cols: int, bias: bool) -> torch.Tensor:
    """Matrix over row-major vec([W | b]) -> flat (W.flatten(), b) order."""
    idx = torch.arange(out * cols).reshape(out, cols)
    if bias:
        idx = torch.cat([idx, (out * cols + torch.arange(out)).unsqueeze(1)], 1)
    idx = idx.reshape(-1)
    res = torch.zeros_like(m)
    res[idx.unsqueeze(1), idx.unsqueeze(0)] = m
    return res


@pytest.mark.parametrize("bias", [True, False])
def test_linear_gaussian_fisher_equals_hessian_equals_closed_form(bias: bool) -> None:
    out, d, n = 2, 3, 7
    model, x, xt = _linear_data(n, d, out, bias)
    y = torch.randn(n, out, dtype=torch.float64)
    expected = _to_param_order(torch.kron(torch.eye(out, dtype=torch.float64), xt.t() @ xt / n), out, d, bias)
    # for the weight alone, in the repo's row-major order this is kron(I_out, XᵀX/N)
    torch.testing.assert_close(expected[:out * d, :out * d], torch.kron(torch.eye(out, dtype=torch.float64), x.t() @ x / n))
    for kind in ("fisher", "hessian"):
        for approx in ("full", "kfac") if kind == "fisher" else ("full",):
            c = curvature.compute(model, x, y, loss="mse", kind=kind, approx=approx)
            torch.testing.assert_close(c.dense(), expected, rtol=0, atol=1e-12)
        diag = curvature.compute(model, x, y, loss="mse", kind=kind, approx="diag").dense()
        torch.testing.assert_close(diag, torch.diag(torch.diagonal(expected)), rtol=0, atol=1e-12)
    blk = curvature.compute(model, x, y, loss="mse", kind="fisher", approx="kfac").blocks[""]
    torch.testing.assert_close(blk.G, torch.eye(out, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(blk.A, xt.t() @ xt / n, rtol=0, atol=1e-12)
    # the empirical Fisher is not the Fisher: (1/N) Σ r_n r_nᵀ ⊗ x̃ x̃ᵀ with residuals r
    ef = curvature.compute(model, x, y, loss="mse", kind="empirical_fisher", approx="full").dense()
    with torch.no_grad():
        r = model(x) - y
    ef_closed = sum(torch.kron(torch.outer(r[i], r[i]), torch.outer(xt[i], xt[i])) for i in range(n)) / n
    torch.testing.assert_close(ef, _to_param_order(ef_closed, out, d, bias), rtol=0, atol=1e-12)
    assert (ef - expected).abs().max() > 1e-2


def test_linear_softmax_fisher_closed_form() -> None:
    out, d, n = 3, 3, 6
    model, x, xt = _linear_data(n, d, out, True)
    y = torch.randint(0, out, (n,))
    with torch.no_grad():
        p = torch.softmax(model(x), 1)
    closed = sum(torch.kron(torch.diag(p[i]) - torch.outer(p[i], p[i]), torch.outer(xt[i], xt[i]))
                 for i in range(n)) / n
    expected = _to_param_order(closed, out, d, True)
    for kind in ("fisher", "hessian"):  # linear model: Hessian of CE = GGN = Fisher
        c = curvature.compute(model, x, y, kind=kind, approx="full")
        torch.testing.assert_close(c.dense(), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("out", [1, 3])
def test_logistic_regression_fisher_equals_hessian_equals_closed_form(out: int) -> None:
    """Linear logits, a Bernoulli on each: Fisher = GGN = Hessian = ``(1/N) Σ_n diag(p_n(1 − p_n)) ⊗ x̃_n x̃_nᵀ``
    (one output: ``X̃ᵀ diag(p(1 − p)) X̃ / N``, logistic regression's); the empirical Fisher takes ``(p − y)²``."""
    d, n = 3, 7
    model, x, xt = _linear_data(n, d, out, True)
    y = torch.randint(0, 2, (n, out), generator=torch.Generator().manual_seed(5)).double()
    with torch.no_grad():
        p = torch.sigmoid(model(x))
    closed = sum(torch.kron(torch.diag(p[i] * (1 - p[i])), torch.outer(xt[i], xt[i])) for i in range(n)) / n
    expected = _to_param_order(closed, out, d, True)
    if out == 1:
        torch.testing.assert_close(closed, xt.t() @ torch.diag(p[:, 0] * (1 - p[:, 0])) @ xt / n)
    for kind in ("fisher", "hessian"):
        c = curvature.compute(model, x, y, loss="binary_cross_entropy", kind=kind, approx="full")
        torch.testing.assert_close(c.dense(), expected, rtol=0, atol=1e-12)
    kfac = curvature.compute(model, x, y, loss="binary_cross_entropy", kind="fisher", approx="kfac").dense()
    if out == 1:  # G is the scalar mean of p(1 − p) and A = X̃ᵀX̃/N: K-FAC drops their correlation
        assert (kfac - expected).abs().max() > 1e-3
    ef = curvature.compute(model, x, y, loss="binary_cross_entropy", kind="empirical_fisher", approx="full").dense()
    r = p - y
    ef_closed = sum(torch.kron(torch.outer(r[i], r[i]), torch.outer(xt[i], xt[i])) for i in range(n)) / n
    torch.testing.assert_close(ef, _to_param_order(ef_closed, out, d, True), rtol=0, atol=1e-12)


def test_binary_cross_entropy_is_torchs_loss() -> None:
    """The NLL is ``F.binary_cross_entropy_with_logits`` summed over an example's outputs, so the Hessian kind
    (the autograd Hessian of the mean NLL) is that of the loss a user writes: reduction='mean' for one output,
    'sum' / N for several; soft labels too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.tensor([[0, 1], [1, 1], [0.3, 0], [1, 0], [0, 0.9]], dtype=torch.float64)
    params = dict(model.named_parameters())
    flat = torch.cat([q.detach().reshape(-1) for q in params.values()])

    def loss(theta):
        i, new = 0, {}
        for k, q in params.items():
            new[k] = theta[i:i + q.numel()].reshape(q.shape)
            i += q.numel()
        f = torch.func.functional_call(model, new, (x,))
        return torch.nn.functional.binary_cross_entropy_with_logits(f, y, reduction="sum") / len(x)

    expected = torch.func.hessian(loss)(flat)
    c = curvature.compute(model, x, y, loss="binary_cross_entropy", kind="hessian", approx="full")
    for name, (start, stop) in (("0", (0, 16)), ("2", (16, 26))):  # "full": one block per module
        torch.testing.assert_close(c.blocks[name].dense(), expected[start:stop, start:stop], rtol=0, atol=1e-12)
    ggn = curvature.compute(model, x, y, loss="binary_cross_entropy", kind="fisher", approx="full")
    assert (c.blocks["0"].dense() - ggn.blocks["0"].dense()).abs().max() > 1e-4  # tanh: the Hessian is not the GGN


def test_fisher_mc_converges_to_fisher() -> None:
    """Seeded: the relative error shrinks roughly like 1/√(N·S); 4000 samples leave a few percent."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    exact = curvature.compute(model, x, y, kind="fisher", approx="full").dense()

    def rel_err(s: int) -> float:
        mc = curvature.compute(model, x, y, kind="fisher_mc", approx="full", mc_samples=s,
                               generator=torch.Generator().manual_seed(42)).dense()
        return float((mc - exact).norm() / exact.norm())

    e_small, e_large = rel_err(4), rel_err(4000)
    assert e_large < 0.05, e_large
    assert e_large < e_small / 5, (e_small, e_large)


def test_fisher_mc_mse_converges_to_fisher() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randn(8, 2, dtype=torch.float64)
    exact = curvature.compute(model, x, y, loss="mse", kind="fisher", approx="kfac").dense()
    mc = curvature.compute(model, x, y, loss="mse", kind="fisher_mc", approx="kfac", mc_samples=4000,
                           generator=torch.Generator().manual_seed(1)).dense()
    assert float((mc - exact).norm() / exact.norm()) < 0.05


def test_fisher_mc_binary_cross_entropy_converges_to_fisher() -> None:
    """Bernoulli labels drawn from sigmoid(f): their outer products average to ``diag(p(1 − p))``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (8, 2)).double()
    exact = curvature.compute(model, x, y, loss="binary_cross_entropy", kind="fisher", approx="full").dense()

    def rel_err(s: int) -> float:
        mc = curvature.compute(model, x, y, loss="binary_cross_entropy", kind="fisher_mc", approx="full",
                               mc_samples=s, generator=torch.Generator().manual_seed(1)).dense()
        return float((mc - exact).norm() / exact.norm())

    e_small, e_large = rel_err(4), rel_err(4000)
    assert e_large < 0.05, e_large
    assert e_large < e_small / 5, (e_small, e_large)


def test_hessian_differs_from_ggn_for_tanh_network() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    for loss, y in (("cross_entropy", torch.randint(0, 3, (6,))), ("mse", torch.randn(6, 3, dtype=torch.float64))):
        h = curvature.compute(model, x, y, loss=loss, kind="hessian", approx="full")
        g = curvature.compute(model, x, y, loss=loss, kind="fisher", approx="full")
        first = (h.blocks["0"].dense() - g.blocks["0"].dense()).abs().max()
        assert first > 1e-3, float(first)
        # the Hessian need not be PSD, the GGN is
        assert torch.linalg.eigvalsh(g.blocks["0"].dense()).min() > -1e-12
        # the output layer is linear in its parameters: there Hessian = GGN exactly
        torch.testing.assert_close(h.blocks["2"].dense(), g.blocks["2"].dense(), rtol=0, atol=1e-12)
