"""The small update steps and fast paths of the per-step overhead work: the batched momentum
update equals torch.optim.SGD, the cheap finiteness checks still catch every bad value, and the
[W | b] matrix layout round-trips for Linear and Conv2d from any row stride."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from curvature.linalg import LinalgError
from curvature.linalg.checks import check_finite
from curvature.modules.conv import Conv2dFamily
from curvature.modules.linear import LinearFamily
from curvature.blocks import DiagBlock, Layout
from torchsso2.optim.steps import momentum_step_


def test_momentum_step_equals_torch_sgd_per_group():
    torch.manual_seed(0)
    shapes = [(3, 4), (4,), (2, 3), (5,)]
    groups = [(0.1, 0.9), (0.1, 0.9), (0.05, 0.0), (0.2, 0.5)]  # (lr, momentum) per tensor
    ours = [torch.randn(s, dtype=torch.float64) for s in shapes]
    ref = [p.clone().requires_grad_() for p in ours]
    sgd = torch.optim.SGD([dict(params=[p], lr=lr, momentum=m) for p, (lr, m) in zip(ref, groups)], lr=1.0)
    states = [dict() for _ in ours]
    for _ in range(3):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        momentum_step_(ours, grads, states, [lr for lr, _ in groups], [m for _, m in groups])
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        sgd.step()
        for a, b in zip(ours, ref):
            assert torch.allclose(a, b.detach(), rtol=1e-15, atol=1e-15)
    assert [("momentum_buffer" in s) for s in states] == [True, True, False, True]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_check_finite_catches_each_bad_value(bad):
    t = torch.randn(5, 5)
    check_finite(t, "op", "input", "torch")
    t[2, 3] = bad
    with pytest.raises(LinalgError, match="1 non-finite"):
        check_finite(t, "op", "input", "torch")


def test_check_finite_accepts_values_whose_sum_overflows():
    t = torch.full((4, 4), 3e38)  # every element finite, the float32 sum is inf
    check_finite(t, "op", "input", "torch")


@pytest.mark.parametrize("module", [nn.Linear(5, 3), nn.Linear(5, 3, bias=False), nn.Conv2d(2, 3, 3)])
def test_weight_matrix_layout_round_trips_from_a_strided_matrix(module):
    fam = LinearFamily() if isinstance(module, nn.Linear) else Conv2dFamily()
    names = [n for n, _ in module.named_parameters()]
    tensors = [torch.randn_like(p) for _, p in module.named_parameters()]
    m = fam.to_matrix(module, tensors, names)
    rows, cols = fam.weight_matrix_shape(module)
    assert m.shape == (rows, cols + (1 if "bias" in names else 0))
    assert torch.equal(m[:, :cols], tensors[0].reshape(rows, cols))
    padded = torch.zeros(rows + 2, m.shape[1] + 3)  # a view with a row stride wider than its columns
    fam.to_matrix_into(module, tensors, names, padded[:rows, :m.shape[1]])
    assert torch.equal(padded[:rows, :m.shape[1]], m)
    for source in (padded[:rows, :m.shape[1]], m.t().contiguous().t()):  # row-strided, column-major
        back = fam.from_matrix(module, source, names)
        assert all(torch.equal(b, t) for b, t in zip(back, tensors))
        assert [b.shape for b in back] == [t.shape for t in tensors]


def _layout() -> Layout:
    return Layout("lin", nn.Linear(4, 3), LinearFamily(), ("weight", "bias"))


def test_unflatten_views_match_slices_for_offsets_and_strides() -> None:
    """The ``as_strided`` fast path (contiguous flat, also at a storage offset) and the slicing
    fallback (strided flat) give the parameter-shaped pieces of ``cat([W.flatten(), b])``."""
    lay = _layout()
    base = torch.arange(40, dtype=torch.float64)
    for flat in (base[:15], base[5:20], base[::2][:15]):  # offset 0, offset 5, stride 2
        w, b = lay.unflatten(flat)
        assert w.shape == (3, 4) and b.shape == (3,)
        assert torch.equal(w.reshape(-1), flat[:12]) and torch.equal(b, flat[12:])
        if flat.stride(0) == 1:
            assert w.data_ptr() == flat.data_ptr()  # views, not copies
    back = lay.flatten(lay.unflatten(base[5:20]))
    assert torch.equal(back, base[5:20])


@pytest.mark.parametrize("vec_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_diag_solve_divides_by_the_damped_diagonal(vec_dtype: torch.dtype) -> None:
    """``DiagBlock.solve`` (one foreach multiply when dtypes match, casts otherwise) returns
    ``g / (scale·d + damping)`` in the gradient's dtype."""
    lay = _layout()
    d = torch.rand(15, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5
    blk = DiagBlock(lay, d)
    blk.decompose(damping=0.1, scale=2.0)
    g = [torch.randn(3, 4).to(vec_dtype), torch.randn(3).to(vec_dtype)]
    out = blk.solve(g)
    want = lay.unflatten(torch.cat([t.double().reshape(-1) for t in g]) / (2.0 * d + 0.1))
    for o, w in zip(out, want):
        assert o.dtype == vec_dtype
        torch.testing.assert_close(o.double(), w, rtol=1e-2 if vec_dtype == torch.bfloat16 else 1e-6, atol=0)
