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
