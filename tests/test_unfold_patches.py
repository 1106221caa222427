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


@pytest.mark.parametrize("channels, size, stride, calls", [(64, 4, 1, 1), (128, 4, 2, 1), (16, 4, 1, 0), (64, 8, 1, 0)])
def test_few_positions_and_many_features_take_f_unfold(monkeypatch: pytest.MonkeyPatch, channels: int, size: int,
                                                        stride: int, calls: int) -> None:
    """At most 16 positions and at least 576 features (a late depthwise layer): ``F.unfold`` (faster there);
    otherwise the strided copy. Either way the patches cut out by slicing (tests/reference.py)."""
    from curvature.modules import conv as conv_module
    from reference import conv_patches
    seen = []
    real = F.unfold

    def counted(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(conv_module.F, "unfold", counted)
    conv = torch.nn.Conv2d(channels, 2, 3, padding=1, stride=stride)
    x = torch.randn(3, channels, size, size, dtype=torch.float64)
    got = unfold_patches(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride).transpose(1, 2)
    assert len(seen) == calls
    torch.testing.assert_close(got, conv_patches(x, conv), rtol=0, atol=0)
