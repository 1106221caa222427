"""Conv2d's K-FAC input factor from offset correlations, without unfolding (stride 1); a Conv1d's too, as
the Conv2d of a ``1 × k`` kernel over ``[N, C, 1, L]`` (:class:`~curvature.modules.conv.ConvView`).

The input factor of a convolution is a sum over unfolded patches,
``Σ_{n,t} a_nt a_ntᵀ`` with ``a_nt [C·kh·kw]`` (``F.unfold`` order: channel-major, then kernel
row ``i``, kernel column ``j``). Its ``(c, i, j), (c', i', j')`` entry is, for stride 1 and the
zero-padded input ``x̄``,

    ``Σ_n Σ_{u ∈ U_i} Σ_{v ∈ V_j} x̄[n, c, u, v] · x̄[n, c', u + Δy, v + Δx]``,
    ``Δy = (i' − i)·dil_h``, ``Δx = (j' − j)·dil_w``, ``U_i = [i·dil_h, i·dil_h + H_out)`` (same for ``V_j``):

a correlation of the input with itself at the offset ``(Δy, Δx)``, summed over a window. All
``(kh·kw)²`` blocks therefore come from the ``(2kh − 1)(2kw − 1)`` offset correlations — half of
them, since the offset ``−Δ`` gives the transposed block — each summed once over the whole
image and corrected by a few border rows and columns (inclusion–exclusion: the window of a
kernel position leaves out at most ``(k − 1)·dil`` rows/columns, most of them zero padding).

Cost: ``≈ 2·N·C²·H·W`` per offset, 13 offsets for a 3×3 kernel, against ``2·N·T·(9C)² = 162·N·T·C²``
for the unfolded product: ~6× fewer FLOPs, and no ``[N, T, 9C]`` patch tensor. The result
equals the unfolded sum up to floating-point rounding (``tests/test_conv_factor.py``).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: use the offset method when its FLOPs are below this fraction of the unfolded product's
OFFSET_COST_FRACTION = 0.5
#: ... and the output has at least this many positions: on small images (8×8) the border
#: corrections and ~100 small kernel launches cost more than the unfolded product
#: (N=128, C=8, 8×8: 10 ms vs 2.7 ms; C=3, 16×16: 4.2 ms vs 7.2 ms; C=32, 32×32: 32 ms vs 214 ms)
MIN_OUTPUT_POSITIONS = 256
#: ... and the input has at least this many channels: with one, every offset correlation is a [1, 1]
#: product and the launches are all there is (one thread, N=128: 28×28 3×3 1.43 ms vs 0.86 ms unfolded;
#: N=64, 32×32 5×5: 7.6 vs 2.3 ms; a Conv1d with N=16, L=300: 0.44 vs 0.05 ms); from two on it depends on
#: the geometry (Conv1d N=32, L=4000, C=2: 0.89 vs 1.91 ms; a 28×28 image with C=2 about even)
MIN_INPUT_CHANNELS = 2


def _pair(v: object) -> Tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))  # type: ignore[index]


def numeric_padding(module: nn.Module) -> Tuple[int, ...]:
    """``module.padding`` as numbers, one per spatial dimension (``(ph, pw)`` for a Conv2d or a
    :class:`~curvature.modules.conv.ConvView`, ``(p,)`` for a Conv1d; their sizes are tuples): ``"valid"``
    is zeros; ``"same"`` (stride 1) is ``dilation · (k − 1) / 2`` per side, where that is whole (torch pads
    an odd total one more at the end, which symmetric padding cannot express: ``ValueError``)."""
    padding = module.padding
    if not isinstance(padding, str):
        return tuple(int(p) for p in padding)
    if padding == "valid":
        return (0,) * len(module.kernel_size)
    pads = []
    for k, d in zip(module.kernel_size, module.dilation):
        total = d * (k - 1)
        if total % 2:
            raise ValueError(f"{type(module).__name__} with padding='same', kernel_size={module.kernel_size} and "
                             f"dilation={module.dilation} pads asymmetrically (a total of {total} per side pair), "
                             "which is not supported; use an odd kernel size or numeric padding with F.pad before "
                             "the layer")
        pads.append(total // 2)
    return tuple(pads)


def offset_factor_pays(module: nn.Module, input_hw: Tuple[int, int]) -> bool:
    """Whether :func:`conv_input_factor` applies (stride 1, groups 1, numeric zero padding) and
    needs fewer FLOPs than the product of unfolded patches for an input of ``input_hw``."""
    if _pair(module.stride) != (1, 1) or module.groups != 1 or module.padding_mode != "zeros" \
            or module.in_channels < MIN_INPUT_CHANNELS:
        return False
    (kh, kw), (dh, dw), (ph, pw) = _pair(module.kernel_size), _pair(module.dilation), numeric_padding(module)
    h, w = input_hw
    hp, wp = h + 2 * ph, w + 2 * pw
    ho, wo = hp - dh * (kh - 1), wp - dw * (kw - 1)
    if ho * wo < MIN_OUTPUT_POSITIONS:
        return False
    offsets = ((2 * kh - 1) * (2 * kw - 1) + 1) // 2
    return offsets * hp * (wp + (kw - 1) * dw) < OFFSET_COST_FRACTION * ho * wo * (kh * kw) ** 2


def _corr(x1: Tensor, x2: Tensor) -> Tensor:
    """``Σ_n x1[n] x2[n]ᵀ`` for ``x1, x2 [N, C, L]`` (any strides): ``[C, C]``."""
    return torch.bmm(x1, x2.transpose(1, 2)).sum(dim=0)


def _excluded(start: int, out: int, padded: int, d: int, pad: int, size: int) -> List[int]:
    """Rows (or columns) ``u`` of the full offset-``d`` range ``[max(0, −d), min(P, P − d))`` outside
    the window ``[start, start + out)`` where both ``u`` and ``u + d`` hold real (not padding) data."""
    lo, hi = max(0, -d), min(padded, padded - d)
    rows = list(range(lo, start)) + list(range(start + out, hi))
    return [u for u in rows if pad <= u < pad + size and pad <= u + d < pad + size]


def conv_input_factor(x: Tensor, kernel_size: object, dilation: object, padding: object, bias: bool) -> Tensor:
    """``Σ_{n,t} ã_nt ã_ntᵀ`` of a stride-1 Conv2d (not normalized), ``ã = [a, 1]`` with ``bias``.

    Args:
        x: the layer input ``[N, C, H, W]``.
        kernel_size, dilation, padding: the module's (int or pair).
        bias: append the constant-1 input (the bias column).

    Returns:
        ``[C·kh·kw (+1), C·kh·kw (+1)]`` in ``F.unfold`` order, in ``x``'s dtype.
    """
    (kh, kw), (dh, dw), (ph, pw) = _pair(kernel_size), _pair(dilation), _pair(padding)
    n, c, h, w = x.shape
    hp, wp = h + 2 * ph, w + 2 * pw
    ho, wo = hp - dh * (kh - 1), wp - dw * (kw - 1)
    extra = (kw - 1) * dw  # zero columns on the right: a flat shift by Δx never wraps into data
    wq = wp + extra
    xq = F.pad(x, (pw, pw + extra, ph, ph))  # [N, C, hp, wq]
    length = hp * wq
    flat = xq.reshape(n, c, length)
    a6 = x.new_zeros(c, kh, kw, c, kh, kw)
    for di in range(kh):
        for dj in range(-(kw - 1), kw):
            if di == 0 and dj < 0:
                continue  # the transpose of offset (0, −dj)
            dy, dx = di * dh, dj * dw
            s = dy * wq + dx
            lo, hi = max(0, -s), min(length, length - s)
            full = _corr(flat[:, :, lo:hi], flat[:, :, lo + s:hi + s])
            row_sums: Dict[int, Tensor] = {}
            col_sums: Dict[int, Tensor] = {}
            v_lo, v_hi = max(0, -dx), min(wq, wq - dx)
            for i in range(kh - di):
                ex_rows = _excluded(i * dh, ho, hp, dy, ph, h)
                for u in ex_rows:
                    if u not in row_sums:
                        f = u * wq
                        row_sums[u] = _corr(flat[:, :, f + v_lo:f + v_hi], flat[:, :, f + v_lo + s:f + v_hi + s])
                for j in range(max(0, -dj), kw - max(0, dj)):
                    ex_cols = _excluded(j * dw, wo, wp, dx, pw, w)
                    block = full.clone()
                    for u in ex_rows:
                        block -= row_sums[u]
                    for v in ex_cols:
                        if v not in col_sums:
                            col_sums[v] = _corr(xq[:, :, 0:hp - dy, v], xq[:, :, dy:hp, v + dx])
                        block -= col_sums[v]
                        for u in ex_rows:
                            block += xq[:, :, u, v].t() @ xq[:, :, u + dy, v + dx]
                    a6[:, i, j, :, i + di, j + dj] = block
                    if di or dj:
                        a6[:, i + di, j + dj, :, i, j] = block.t()
    m = c * kh * kw
    big = a6.reshape(m, m)
    if not bias:
        return big
    # Σ_{n,t} a_nt: window sums of the batch-summed padded input, from 2-D prefix sums
    summed = F.pad(xq.sum(dim=0)[:, :, :wp], (1, 0, 1, 0)).cumsum(1).cumsum(2)  # [C, hp+1, wp+1]
    col = x.new_empty(c, kh, kw)
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dh, j * dw
            r1, c1 = r0 + ho, c0 + wo
            col[:, i, j] = summed[:, r1, c1] - summed[:, r0, c1] - summed[:, r1, c0] + summed[:, r0, c0]
    out = x.new_empty(m + 1, m + 1)
    out[:m, :m] = big
    out[:m, m] = col.reshape(m)
    out[m, :m] = col.reshape(m)
    out[m, m] = n * ho * wo
    return out
