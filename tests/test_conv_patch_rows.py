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
