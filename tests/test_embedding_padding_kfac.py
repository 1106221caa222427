"""nn.Embedding K-FAC with ``padding_idx``: padding positions reach no row, so the input factor counts
tokens over the positions that do. Checked against the full block where K-FAC is exact: one example,
and a linear-Gaussian embedding (position-wise mse) over several examples with uneven padding."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature


class _Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(5, 3, padding_idx=0)
        self.fc = nn.Linear(3, 3)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.e(t)).sum(1))


@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher"])
@pytest.mark.parametrize("tokens", [[[3, 0]], [[0, 0, 4, 0]], [[2]]])  # one real token: K-FAC is exact
def test_one_example_kfac_is_the_full_block_with_padding(kind: str, tokens) -> None:
    torch.manual_seed(0)
    model = _Pooled().double()
    x, y = torch.tensor(tokens), torch.tensor([1])
    k = curvature.compute(model, x, y, kind=kind, approx="kfac").dense()
    f = curvature.compute(model, x, y, kind=kind, approx="full").dense()
    torch.testing.assert_close(k[:15, :15], f[:15, :15], rtol=1e-10, atol=1e-12)  # the embedding's block


@pytest.mark.parametrize("padding_idx", [None, 1])
def test_linear_gaussian_embedding_kfac_is_the_fisher_with_uneven_padding(padding_idx) -> None:
    torch.manual_seed(0)
    e = nn.Embedding(6, 3, padding_idx=padding_idx).double()
    x = torch.tensor([[0, 1, 1, 2], [1, 3, 3, 5], [4, 4, 1, 1]])
    y = torch.randn(3, 4, 3, dtype=torch.float64)
    k = curvature.compute(e, x, y, loss="mse", kind="fisher", approx="kfac").dense()
    f = curvature.compute(e, x, y, loss="mse", kind="fisher", approx="full").dense()
    torch.testing.assert_close(k, f, rtol=1e-12, atol=1e-14)
    assert float(f.diagonal().max()) > 0


def test_all_padding_gives_a_zero_factor_not_nan() -> None:
    e = nn.Embedding(4, 2, padding_idx=0).double()
    x = torch.zeros(2, 3, dtype=torch.long)
    y = torch.randn(2, 3, 2, dtype=torch.float64)
    k = curvature.compute(e, x, y, loss="mse", kind="fisher", approx="kfac").dense()
    assert torch.equal(k, torch.zeros_like(k))
