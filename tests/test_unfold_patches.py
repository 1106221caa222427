"""``unfold_patches`` equals ``F.unfold`` exactly (it only copies) on every conv geometry."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from curvature.modules.conv import unfold_patches

# (input [N, C, H, W], kernel, dilation, padding, stride)
GEOMETRIES = [
    ((2, 3, 7, 6), 3, 1, 1, 1),
    ((2, 3, 7, 6), 3, 1, 1, 2),
    ((1, 2, 9, 8), (2, 3), 1, 0, 1),
    ((3, 1, 8, 8), 1, 1, 0, 1),
    ((2, 4, 10, 9), 3, 2, 2, 1),
    ((2, 4, 10, 9), (3, 2), (2, 1), (1, 2), (2, 1)),
    ((2, 2, 5, 5), 5, 1, 2, 3),
    ((1, 2, 6, 11), (1, 4), (1, 3), (0, 3), (1, 2)),
]


@pytest.mark.parametrize("shape, kernel, dilation, padding, stride", GEOMETRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unfold_patches_equals_f_unfold(shape, kernel, dilation, padding, stride, dtype) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    want = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    got = unfold_patches(x, kernel, dilation=dilation, padding=padding, stride=stride)
    assert got.shape == want.shape and got.dtype == dtype
    assert torch.equal(got, want)


def test_unfold_patches_non_contiguous_input() -> None:
    """A channels-last (non-contiguous) input gives the same patches."""
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    assert torch.equal(unfold_patches(x, 3, padding=1, stride=2), F.unfold(x, 3, padding=1, stride=2))
