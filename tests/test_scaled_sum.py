"""``curvature.engine._scaled_sum``: the empirical Fisher's recorded output gradients, summed over the
backward passes that recorded them and scaled to the summed loss, without the builtin ``sum``'s extra
copy: bit-equal to ``sum(grads) * s`` (the factors it feeds are checked against brute force in
tests/test_kfac_time_to_accuracy_benchmark.py)."""
from __future__ import annotations

import pytest
import torch

from curvature.engine import _scaled_sum


@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bit_equal_to_builtin_sum_times_scale(count: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(count)
    ts = [torch.randn(7, 3, 5, generator=g, dtype=dtype) for _ in range(count)]
    ts[0][0, 0, 0] = -0.0
    for s in (1.0, 128.0, 0.37):
        assert torch.equal(_scaled_sum(ts, s), sum(ts) * s)


def test_inputs_are_not_written() -> None:
    ts = [torch.randn(4, 3), torch.randn(4, 3)]
    before = [t.clone() for t in ts]
    _scaled_sum(ts, 3.0)
    _scaled_sum(ts[:1], 3.0)
    for a, b in zip(ts, before):
        assert torch.equal(a, b)

