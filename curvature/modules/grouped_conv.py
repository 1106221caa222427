"""Per-example gradients of a grouped convolution (``groups > 1``: depthwise, ResNeXt-style), for its diagonal
and full blocks.

A convolution with ``G`` groups applies group ``j``'s rows of the weight ``[C_out, C_in/G·∏k]`` (output channels
``j·C_out/G …``) to group ``j``'s features of the unfolded patch ``a_t [C_in·∏k]`` (channel-major: the slice
``[j·D, (j + 1)·D)``, ``D = C_in/G·∏k``). So the per-example weight gradient of output channel ``o`` in group
``j`` is ``Σ_t g_t[o] a_t[j·D : (j + 1)·D]``: the patches and output gradients of the ungrouped normal form,
split into groups (:func:`split_groups`), give it in the weight's own row-major order. K-FAC is not defined
for such a layer (each group would need its own pair of factors): K-FAC asked by default or by layer type gives
it the diagonal, a key naming the module raises.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

#: largest per-example-gradient chunk ``[n, K, C_out, D]`` formed at once by :func:`grouped_sum_sq` (elements)
CHUNK_ELEMENTS = 1 << 22


def split_groups(a: Tensor, g: Tensor, groups: int) -> Tuple[Tensor, Tensor]:
    """``a [N, T, C_in·∏k]`` → ``[N, T, G, D]`` and ``g [K, N, T, C_out]`` → ``[K, N, T, G, C_out/G]`` (views
    where the layouts allow)."""
    n, t, d = a.shape
    k, _, _, c_out = g.shape
    return a.reshape(n, t, groups, d // groups), g.reshape(k, n, t, groups, c_out // groups)


def grouped_per_example(a: Tensor, g: Tensor, groups: int) -> Tensor:
    """Per-example weight gradients ``[K, N, C_out, D]`` (rows of the weight ``[C_out, C_in/G·∏k]``)."""
    ag, gg = split_groups(a.to(g.dtype), g, groups)
    k, n = g.shape[:2]
    return torch.einsum("ntgj,kntgo->kngoj", ag, gg).reshape(k, n, g.shape[3], ag.shape[3])


def grouped_sum_sq(a: Tensor, g: Tensor, groups: int) -> Tensor:
    """``Σ_{k,n}`` of the squared per-example weight gradients, ``[C_out, D]``, a chunk of examples at a time
    (at most :data:`CHUNK_ELEMENTS` elements of per-example gradients held)."""
    ag, gg = split_groups(a.to(g.dtype), g, groups)
    k, n, _, _, o = gg.shape
    per_example = k * groups * o * ag.shape[3]
    step = max(1, CHUNK_ELEMENTS // max(1, per_example))
    total = g.new_zeros(groups, o, ag.shape[3])
    for s in range(0, n, step):
        total += torch.einsum("ntgj,kntgo->kngoj", ag[s:s + step], gg[:, s:s + step]).pow_(2).sum(dim=(0, 1))
    return total.reshape(groups * o, ag.shape[3])
