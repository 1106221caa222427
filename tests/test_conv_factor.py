"""Conv2d's K-FAC input factor from offset correlations (curvature/modules/conv_factor.py) equals
the product of unfolded patches, for every stride-1 geometry; the engine uses it where it pays."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from curvature.modules.base import ones_column, sum_outer
from curvature.modules.conv_factor import conv_input_factor, offset_factor_pays

GEOMETRIES = [  # (kernel, dilation, padding, H, W)
    ((3, 3), (1, 1), (1, 1), 6, 5),
    ((3, 3), (1, 1), (0, 0), 6, 6),
    ((3, 3), (2, 2), (2, 2), 7, 6),
    ((3, 3), (1, 2), (0, 3), 5, 8),
    ((5, 5), (1, 1), (2, 2), 7, 7),
    ((5, 3), (1, 1), (1, 2), 6, 4),
    ((2, 2), (1, 1), (0, 0), 4, 5),
    ((2, 4), (1, 1), (1, 3), 3, 3),
    ((1, 3), (1, 1), (0, 1), 4, 4),
    ((3, 3), (1, 1), (3, 3), 2, 2),   # padding larger than the image
    ((4, 4), (1, 1), (1, 1), 4, 4),   # window excludes rows with data on both sides
    ((3, 3), (1, 3), (1, 1), 6, 9),   # width dilation 3 and more: the window's extent (k - 1)·d
    ((2, 4), (2, 3), (1, 0), 7, 12),
    ((1, 3), (1, 4), (0, 0), 3, 9),
]


def _unfolded(x, kernel, dilation, padding, bias):
    a = F.unfold(x, kernel, dilation=dilation, padding=padding).transpose(1, 2)
    return sum_outer(ones_column(a) if bias else a)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
@pytest.mark.parametrize("bias", [True, False])
def test_offset_factor_equals_unfolded(geometry, bias: bool) -> None:
    kernel, dilation, padding, h, w = geometry
    gen = torch.Generator().manual_seed(h * 10 + w)
    x = torch.randn(3, 2, h, w, generator=gen, dtype=torch.float64)
    got = conv_input_factor(x, kernel, dilation, padding, bias)
    want = _unfolded(x, kernel, dilation, padding, bias)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_cost_rule() -> None:
    assert offset_factor_pays(nn.Conv2d(64, 64, 3, padding=1), (32, 32))
    assert not offset_factor_pays(nn.Conv2d(64, 64, 1), (32, 32))          # 1×1: nothing to share
    assert not offset_factor_pays(nn.Conv2d(64, 64, 3, stride=2, padding=1), (32, 32))  # stride 2
    # "same" is the numeric padding 1 here
    assert offset_factor_pays(nn.Conv2d(4, 4, 3, padding="same"), (16, 16)) == \
        offset_factor_pays(nn.Conv2d(4, 4, 3, padding=1), (16, 16))
    assert not offset_factor_pays(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), (16, 16))
    assert not offset_factor_pays(nn.Conv2d(8, 8, 3, padding=1), (8, 8))  # small image: overhead wins
    assert not offset_factor_pays(nn.Conv2d(1, 8, 3, padding=1), (28, 28))  # one input channel: launches only


@pytest.mark.parametrize("bias", [True, False])
def test_engine_kfac_conv_uses_offsets_and_matches_unfolded(bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same K-FAC blocks with the offset method and with the unfolded product (forced)."""
    from curvature.modules import conv_factor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=bias), nn.ReLU(), nn.Conv2d(4, 5, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(5 * 16 * 16, 3)).double()
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.float64), torch.randint(0, 3, (4,))
    calls = []
    original = conv_factor.conv_input_factor

    def spy(*args, **kw):
        calls.append(1)
        return original(*args, **kw)
    monkeypatch.setattr(conv_factor, "conv_input_factor", spy)
    fast = curvature.compute(model, x, y, kind="fisher", approx="kfac")
    assert len(calls) == 2
    monkeypatch.setattr(conv_factor, "OFFSET_COST_FRACTION", 0.0)
    slow = curvature.compute(model, x, y, kind="fisher", approx="kfac")
    assert len(calls) == 2
    for name, blk in fast.blocks.items():
        torch.testing.assert_close(blk.dense(), slow.blocks[name].dense(), rtol=1e-12, atol=1e-12)
