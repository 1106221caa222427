"""The square root of the output Hessian (exact Fisher / GGN backpropagated vectors).

Cross-entropy: ``H = diag(p) − p pᵀ`` is factored with ``C − 1`` columns (one backward pass
fewer than the symmetric root); the factor must reproduce ``H`` to float64 round-off for any
logits, including saturated softmax outputs and the degenerate ``C = 1``, ``C = 2`` cases.
"""
from __future__ import annotations

import pytest
import torch

from curvature.likelihoods import sqrt_output_hessian
from curvature.options import LossType


def _hessian_of_ce(f: torch.Tensor) -> torch.Tensor:
    """Brute force: ``∂²ℓ/∂f²`` of ``ℓ = −log softmax(f)[y]`` (independent of ``y``), per example."""
    return torch.stack([torch.autograd.functional.hessian(
        lambda z: torch.nn.functional.cross_entropy(z.unsqueeze(0), torch.tensor([0])), fn) for fn in f])


@pytest.mark.parametrize("c", [1, 2, 3, 10])
@pytest.mark.parametrize("scale", [0.1, 3.0, 60.0])
def test_cross_entropy_factor_reproduces_output_hessian(c: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(c)
    f = torch.randn(6, c, dtype=torch.float64, generator=gen) * scale
    m = sqrt_output_hessian(LossType.CROSS_ENTROPY, f)
    assert m.shape == (max(c - 1, 1), 6, c)
    got = torch.einsum("kni,knj->nij", m, m)
    torch.testing.assert_close(got, _hessian_of_ce(f), rtol=0, atol=1e-14)


def test_cross_entropy_factor_saturated_last_class() -> None:
    """``p`` = one-hot on the reflected class (``s_C = 1``) and on another class: H = 0 exactly."""
    f = torch.tensor([[0.0, 0.0, 800.0], [800.0, 0.0, 0.0], [-800.0, -800.0, 0.0]], dtype=torch.float64)
    m = sqrt_output_hessian(LossType.CROSS_ENTROPY, f)
    assert torch.isfinite(m).all()
    torch.testing.assert_close(torch.einsum("kni,knj->nij", m, m), torch.zeros(3, 3, 3, dtype=torch.float64),
                               rtol=0, atol=1e-300)


def test_gaussian_factor_is_identity() -> None:
    f = torch.randn(4, 3, dtype=torch.float64)
    m = sqrt_output_hessian(LossType.MSE, f)
    assert m.shape == (3, 4, 3)
    torch.testing.assert_close(torch.einsum("kni,knj->nij", m, m), torch.eye(3, dtype=torch.float64).expand(4, 3, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("samples", [1, 3])
def test_categorical_mc_vectors_are_softmax_minus_one_hot_of_the_draws_bit_for_bit(dtype, samples):
    """fisher_mc's categorical vectors (p − onehot(ỹ)) / √S, written by a scatter of −1 into p, equal
    the one-hot subtraction exactly, with the draws of the same generator stream."""
    import math
    import torch.nn.functional as F
    from curvature.likelihoods import _categorical_mc_vectors
    f = (torch.randn(50, 7, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    got = _categorical_mc_vectors(f, samples, torch.Generator().manual_seed(5))
    wide = dtype in (torch.float32, torch.float64)
    p = torch.softmax((f if wide else f.float()).t(), dim=0).t()  # 7 classes: the class-major kernel
    u = torch.rand(50, samples, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    draws = torch.searchsorted(p.double().cumsum(1), u, right=True)  # inverse CDF: first class with CDF > u
    probs = p if wide else torch.softmax(f.t(), dim=0).t()
    want = (probs.unsqueeze(0) - F.one_hot(draws.t(), 7).to(probs.dtype)) * (1.0 if samples == 1 else 1 / math.sqrt(samples))
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_draw_classes_has_the_distribution_of_each_row() -> None:
    """draw_classes (inverse CDF) against the row probabilities: 200000 draws per row; each class
    frequency within 5 standard errors of its probability (sd = √(p(1−p)/n) ≤ 0.0011; a false
    failure has probability < 1e-5 per class); a class of probability 0 is never drawn."""
    from curvature.likelihoods import draw_classes
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0],
                          [0.999, 0.001, 0.0, 0.0]], dtype=torch.float64)
    n = 200_000
    draws = draw_classes(probs, n, torch.Generator().manual_seed(0))
    assert draws.shape == (4, n) and draws.dtype == torch.int64
    for row, p in zip(draws, probs):
        freq = torch.bincount(row, minlength=4).double() / n
        sd = (p * (1 - p) / n).sqrt()
        assert torch.all((freq - p).abs() <= 5 * sd + 1e-12), (freq, p)
        assert torch.all(freq[p == 0] == 0)


def test_draw_classes_is_seeded_and_stays_in_range_when_the_cdf_rounds_below_one() -> None:
    """The same generator seed gives the same classes; a row whose probabilities sum to less than 1
    (float32 rounding) never yields an index past the last class."""
    from curvature.likelihoods import draw_classes
    probs = torch.softmax(torch.randn(64, 10, generator=torch.Generator().manual_seed(2)) * 4, dim=1)
    a = draw_classes(probs, 3, torch.Generator().manual_seed(7))
    b = draw_classes(probs, 3, torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and a.shape == (64, 3)
    short = torch.full((1, 4), 0.2)  # sums to 0.8: draws with u >= 0.8 are past the CDF
    d = draw_classes(short, 10_000, torch.Generator().manual_seed(1))
    assert int(d.max()) == 3 and int(d.min()) >= 0


def test_sample_targets_and_fisher_mc_vectors_draw_the_same_labels() -> None:
    """fisher_mc's categorical vectors are nll_grad at the labels sample_targets draws from the same
    generator stream (bit for bit)."""
    from curvature.likelihoods import _categorical_mc_vectors, nll_grad, sample_targets
    f = torch.randn(40, 6, generator=torch.Generator().manual_seed(3)) * 2
    ys = sample_targets(LossType.CROSS_ENTROPY, f, 2, torch.Generator().manual_seed(9))
    v = _categorical_mc_vectors(f, 2, torch.Generator().manual_seed(9))
    want = torch.stack([nll_grad(LossType.CROSS_ENTROPY, f, y) for y in ys]) * (1.0 / 2 ** 0.5)
    assert torch.equal(v, want)


@pytest.mark.parametrize("shape", [(5,), (5, 1), (5, 3), (5, 1, 2, 2)])
@pytest.mark.parametrize("scale", [0.1, 3.0, 60.0])
def test_bernoulli_factor_reproduces_output_hessian(shape, scale) -> None:
    """``Σ_k S_k S_kᵀ = ∂²ℓ/∂f²`` of ``ℓ = Σ BCE(f, y)`` (independent of ``y``) for one logit, several, a mask;
    saturated logits (×60) keep the diagonal ``p(1 − p)`` to float64 round-off, not ``0`` from ``1 − p``."""
    f = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * scale
    s = sqrt_output_hessian(LossType.BINARY_CROSS_ENTROPY, f)
    d = f[0].numel()
    assert s.shape == (d,) + shape
    m = s.reshape(d, 5, d)
    got = torch.einsum("kni,knj->nij", m, m)
    y = torch.zeros(d, dtype=torch.float64)
    want = torch.stack([torch.autograd.functional.hessian(
        lambda z: torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="sum"), fn)
        for fn in f.reshape(5, d)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)  # (autograd's 1 − p rounds to 0 when saturated)
    e = torch.exp(-f.reshape(5, d).abs())
    torch.testing.assert_close(got, torch.diag_embed(e / (1 + e) ** 2), rtol=1e-12, atol=0)  # p(1 − p), no rounding


def test_bernoulli_draws_are_seeded_match_fisher_mc_and_have_the_distribution() -> None:
    """fisher_mc's Bernoulli vectors are ``p − ỹ`` at the labels sample_targets draws from the same stream (bit
    for bit, float32 and float64 alike); the draws' mean is ``p``."""
    from curvature.likelihoods import backprop_vectors, nll_grad, sample_targets
    from curvature.options import Kind
    f = torch.randn(40, 3, generator=torch.Generator().manual_seed(3)) * 2
    ys = sample_targets(LossType.BINARY_CROSS_ENTROPY, f, 2, torch.Generator().manual_seed(9))
    assert ys.shape == (2, 40, 3) and set(ys.unique().tolist()) <= {0.0, 1.0}
    v = backprop_vectors(LossType.BINARY_CROSS_ENTROPY, Kind.FISHER_MC, f, None, 2, torch.Generator().manual_seed(9))
    want = torch.stack([nll_grad(LossType.BINARY_CROSS_ENTROPY, f, y) for y in ys]) * (1.0 / 2 ** 0.5)
    torch.testing.assert_close(v, want, rtol=0, atol=0)
    ys64 = sample_targets(LossType.BINARY_CROSS_ENTROPY, f.double(), 2, torch.Generator().manual_seed(9))
    assert torch.equal(ys64.float(), ys)
    many = sample_targets(LossType.BINARY_CROSS_ENTROPY, f[:4], 20000, torch.Generator().manual_seed(1))
    torch.testing.assert_close(many.mean(0), torch.sigmoid(f[:4]), rtol=0, atol=0.02)
