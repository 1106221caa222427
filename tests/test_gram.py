"""``sum_outer`` / ``sum_outer_with_ones``: every input layout and both scale placements give
``scale · Σ x xᵀ`` of the row-major reshape (float64 reference)."""
import pytest
import torch

from curvature.modules.base import feature_rows, ones_column, sum_outer, sum_outer_with_ones


def _reference(x: torch.Tensor, scale: float, ones: bool) -> torch.Tensor:
    x2 = x.double().reshape(-1, x.shape[-1])
    if ones:
        x2 = torch.cat([x2, x2.new_ones(x2.shape[0], 1)], dim=1)
    return scale * x2.t() @ x2


def _layouts(k: int, n: int, t: int, d: int):
    g = torch.Generator().manual_seed(k * 100 + t * 10 + d)
    raw = torch.randn(k, n, d, t, generator=g)
    return {
        "contiguous": torch.randn(k, n, t, d, generator=g),
        "feature-major view (conv)": raw.transpose(-1, -2),          # [K, N, T, d] over [K, N, d, T]
        "sliced rows": torch.randn(k, n, 2 * t, d, generator=g)[:, :, ::2],
    }


@pytest.mark.parametrize("shape", [(1, 16, 8, 5), (3, 4, 6, 40), (2, 5, 1, 7), (1, 1, 1, 3)])
@pytest.mark.parametrize("scale", [1.0, 0.125])
@pytest.mark.parametrize("ones", [False, True])
def test_sum_outer_matches_reference_for_every_layout(shape, scale, ones):
    for name, x in _layouts(*shape).items():
        got = (sum_outer_with_ones if ones else sum_outer)(x, scale)
        want = _reference(x, scale, ones)
        assert got.shape == want.shape, name
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), name


def test_feature_rows_is_a_copy_along_runs_for_feature_major_input():
    raw = torch.randn(2, 3, 4, 5)            # [K, N, d, T]
    x = raw.transpose(-1, -2)                # [K, N, T, d]
    m = feature_rows(x)
    assert m.shape == (4, 2 * 3 * 5) and m.is_contiguous()
    assert torch.equal(m, x.reshape(-1, 4).t())
    y = torch.randn(6, 4)                    # contiguous: a view, no copy
    assert feature_rows(y).data_ptr() == y.data_ptr()


def test_sum_outer_with_ones_equals_ones_column_route():
    x = torch.randn(3, 7, 4).transpose(1, 2)
    assert torch.allclose(sum_outer_with_ones(x, 0.5), sum_outer(ones_column(x), 0.5), rtol=1e-6, atol=1e-6)
