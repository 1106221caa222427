"""An nn.Embedding's curvature at the cost of the rows a batch saw.

The diagonal from the (example, token) sums, not from the dense [K, N, V, D] per-example gradients (a
50000-row table at 64×16 tokens took 2.4 GB and seconds per step; exact Fisher ran out of memory):
equal to the per-example definition, repeated tokens within an example summed before squaring, the
padding row zero. K-FAC's solve on the nonzero rows only."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature
from curvature.modules.base import flat_per_example
from curvature.modules.embedding import EmbeddingFamily


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("k", [1, 3])
def test_diag_sum_is_the_sum_of_squared_per_example_gradients(padding_idx, k: int) -> None:
    fam = EmbeddingFamily()
    module = nn.Embedding(7, 3, padding_idx=padding_idx).double()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 7, (5, 6), generator=gen)
    tokens[0, :3] = 4  # a token repeated inside one example: its gradients add before the square
    g = torch.randn(k, 5, 6, 3, dtype=torch.float64, generator=gen)
    per_example = flat_per_example(fam.per_example_grads(module, tokens, g, ["weight"]), ["weight"])
    expected = per_example.reshape(-1, 21).pow(2).sum(0)
    torch.testing.assert_close(fam.diag_sum(module, tokens, g, ["weight"]), expected, rtol=1e-12, atol=1e-14)


def test_a_wide_table_gets_its_diagonal_from_the_tokens_it_saw() -> None:
    """Embedding(50000, 16) at 32×8 tokens: only the rows of the batch's tokens are nonzero, and they
    equal the same computation on a table holding just those rows (the tokens renumbered)."""
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Embedding(50000, 16), nn.Flatten(), nn.Linear(8 * 16, 3))
    tokens = torch.randint(0, 50000, (32, 8))
    y = torch.randint(0, 3, (32,))
    used, renumbered = torch.unique(tokens, return_inverse=True)
    small = nn.Sequential(nn.Embedding(len(used), 16), nn.Flatten(), nn.Linear(8 * 16, 3))
    with torch.no_grad():
        small[0].weight.copy_(wide[0].weight[used])
        small[2].load_state_dict(wide[2].state_dict())
    big = curvature.compute(wide, tokens, y, kind="empirical_fisher", approx="diag").diagonal()[0]
    ref = curvature.compute(small, renumbered, y, kind="empirical_fisher", approx="diag").diagonal()[0]
    torch.testing.assert_close(big[used], ref, rtol=1e-5, atol=1e-9)
    rest = torch.ones(50000, dtype=torch.bool)
    rest[used] = False
    assert bool((big[rest] == 0).all())


@pytest.mark.parametrize("width", [24, 260])  # 260: the right basis zero-padded to 264 for BLAS
def test_kfac_solve_of_a_wide_table_works_on_the_rows_the_batch_saw(monkeypatch, width: int) -> None:
    """K-FAC's left factor of an Embedding is diagonal (token counts), so its solve is row by row and a
    zero gradient row solves to zero: the rows a batch saw are solved alone (two GEMMs over the whole
    table per step before). The same result as the dense solve, and (A ⊗ G + λI) x = g."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(3000, width), nn.Flatten(), nn.Linear(4 * width, 3)).double()
    tokens, y = torch.randint(0, 3000, (16, 4)), torch.randint(0, 3, (16,))
    blk = curvature.compute(model, tokens, y, kind="empirical_fisher", approx="kfac").blocks["0"]
    blk.decompose(0.1)
    grad = torch.zeros(3000, width, dtype=torch.float64)
    seen = torch.unique(tokens)
    grad[seen] = torch.randn(len(seen), width, dtype=torch.float64)
    real, ran = type(blk)._solve_rows, []

    def counted(*args):
        ran.append(real(*args))
        return ran[-1]
    monkeypatch.setattr(type(blk), "_solve_rows", staticmethod(counted))
    sparse = blk.solve([grad])[0]
    assert len(ran) == 1 and ran[0] is not None  # the row path ran
    torch.testing.assert_close(blk.mvp([sparse])[0] + 0.1 * sparse, grad, rtol=1e-10, atol=1e-12)
    monkeypatch.setattr(type(blk), "_solve_rows", staticmethod(lambda *args: None))
    torch.testing.assert_close(sparse, blk.solve([grad])[0], rtol=1e-12, atol=1e-14)
    grad[0, 0] = float("nan")  # a non-finite row stays non-finite (the optimizers' check sees it)
    monkeypatch.undo()
    assert not bool(torch.isfinite(blk.solve([grad])[0]).all())
