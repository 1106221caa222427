"""Conv2d K-FAC input factor from the patches copied once (``patch_rows``), used where the offset
correlations do not pay: the same factors as the general normal-form path (to rounding: its
columns come position-major, so the Gram matrix sums them in another order)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvature.modules.base import ones_column, sum_outer
from curvature.modules.conv import Conv2dFamily, patch_rows, unfold_patches
from curvature.modules.linear import WeightMatrixFamily

GEOMETRIES = [  # (C_in, C_out, kernel, stride, padding, dilation, H, W)
    (1, 8, 3, 1, 1, 1, 8, 8),
    (8, 16, 3, 1, 1, 1, 4, 4),
    (3, 4, (3, 2), 2, (1, 0), 1, 9, 7),
    (2, 3, 3, 1, 2, 2, 6, 6),
    (4, 5, 2, 2, 0, 1, 2, 2),  # one output position
    # asymmetric stride and dilation: rows and columns must each take their own
    (2, 3, (3, 2), (2, 1), (1, 1), 1, 9, 8),
    (2, 3, (3, 2), (1, 2), (1, 1), (2, 1), 9, 8),
    (2, 3, 3, (2, 1), (1, 1), (1, 2), 9, 8),
    (2, 3, (2, 3), (3, 2), (1, 1), (2, 1), 9, 8),
]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("bias", [True, False])
def test_patch_rows_is_the_feature_major_unfolded_input(geometry, bias: bool) -> None:
    cin, _, k, s, p, d, h, w = geometry
    x = torch.randn(5, cin, h, w, dtype=torch.float64)
    patches = unfold_patches(x, k, dilation=d, padding=p, stride=s)  # [N, C·k², T]
    ref = F.unfold(x, k, dilation=d, padding=p, stride=s)
    assert torch.equal(patches, ref)
    a = patches.transpose(1, 2)
    a = ones_column(a) if bias else a
    want = a.transpose(0, 1).reshape(-1, a.shape[-1]).t()  # columns position-major: t·N + n
    assert torch.equal(patch_rows(x, k, dilation=d, padding=p, stride=s, ones_row=bias), want)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kfac_factors_equal_the_general_path(geometry, bias: bool, dtype) -> None:
    cin, cout, k, s, p, d, h, w = geometry
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, k, stride=s, padding=p, dilation=d, bias=bias).to(dtype)
    x = torch.randn(6, cin, h, w, dtype=dtype)
    out = conv(x)
    g = torch.randn((2,) + tuple(out.shape), dtype=dtype)  # K = 2 backpropagated vectors
    fam = Conv2dFamily()
    names = ("weight", "bias") if bias else ("weight",)
    gn = fam.normal_output_grad(conv, g)
    fast = fam.kfac_factors_from_inputs(conv, (x,), out, gn, names)
    general = WeightMatrixFamily.kfac_factors_from_inputs(fam, conv, (x,), out, gn, names)
    assert torch.equal(fast[0], general[0])  # the output factor: the same computation
    # the input factor sums the same products in another order (columns position-major)
    torch.testing.assert_close(fast[1], general[1], rtol=1e-12 if dtype is torch.float64 else 1e-6, atol=1e-7)
    # against the definition: A = Σ_{n,t} ã ãᵀ / (N·T) over the unfolded patches (with the ones for the bias)
    a = unfold_patches(x, k, dilation=d, padding=p, stride=s).transpose(1, 2)
    a = ones_column(a) if bias else a
    torch.testing.assert_close(fast[1], sum_outer(a, 1.0 / (a.shape[0] * a.shape[1])), rtol=1e-5, atol=1e-6)


# (C_in, C_out, kernel, stride, padding, N, H, W, takes the bias-row split)
SPLIT_CASES = [
    (8, 16, 3, 1, 1, 128, 4, 4, True),     # the digits CNN's conv2 at batch 128: [72 (+1), 2048]
    (16, 4, 2, 2, 0, 32, 16, 16, True),    # d = 64, stride 2: [64 (+1), 2048]
    (8, 16, 3, 1, 1, 4, 4, 4, False),      # d = 72 but 64 columns: the ones row stays
    (1, 8, 3, 1, 1, 128, 8, 8, False),     # d = 9: the ones row stays
    (7, 4, 3, 1, 1, 128, 4, 4, False),     # d = 63: not a multiple of 8
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[f"d{c[0] * c[2] ** 2}-split{c[-1]}" for c in SPLIT_CASES])
def test_input_factor_with_and_without_the_bias_row_split_equals_brute_force(case) -> None:
    """Both branches of the patch Gram (:func:`gram_with_ones_row` for large ``d % 8 == 0`` factors,
    the stacked ones row otherwise) against the float64 definition ``Σ ã ãᵀ / (N·T)``."""
    from curvature.modules.conv import patch_columns, split_bias_row

    cin, cout, k, s, p, n, h, w, split = case
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, k, stride=s, padding=p)
    x = torch.randn(n, cin, h, w)
    out = conv(x)
    m = patch_rows(x, k, padding=p, stride=s)
    assert patch_columns(x, conv) == m.shape[1]
    assert split_bias_row(m.shape[0], m.shape[1]) is split
    fam = Conv2dFamily()
    gn = fam.normal_output_grad(conv, torch.randn((1,) + tuple(out.shape)))
    a_fast = fam.kfac_factors_from_inputs(conv, (x,), out, gn, ("weight", "bias"))[1]
    a = ones_column(unfold_patches(x.double(), k, padding=p, stride=s).transpose(1, 2))
    ref = sum_outer(a, 1.0 / (a.shape[0] * a.shape[1]))
    assert a_fast.dtype == torch.float32 and a_fast.shape == ref.shape
    torch.testing.assert_close(a_fast.double(), ref, rtol=1e-5, atol=1e-6)
    assert float(a_fast[-1, -1]) == 1.0  # the ones row's own entry: exactly M / M


def test_gram_with_ones_row_is_the_gram_of_the_stacked_matrix() -> None:
    from curvature.modules.base import gram
    from curvature.modules.conv import gram_with_ones_row

    m = torch.randn(72, 300, dtype=torch.float64)
    stacked = torch.cat([m, m.new_ones(1, 300)])
    torch.testing.assert_close(gram_with_ones_row(m, 1 / 300), gram(stacked, 1 / 300), rtol=1e-13, atol=1e-14)
