"""KL clipping of the preconditioned gradient (Ba et al. 2017; kfac_pytorch's ``kl_clip``).

With ``p`` the preconditioned and ``g`` the raw gradient of every registered layer, the
step ``-lr·p`` changes the model's output distribution by about ``½·lr²·Σ pᵀ F p ≈ ½·lr²·Σ pᵀ g``
(``F p ≈ g``). All preconditioned gradients are multiplied by

    ν = min(1, sqrt(kl_clip / |lr² · Σ_layers Σ p ⊙ g|))      (ν = 1 when the sum is 0)

so that this estimate stays below ``kl_clip``.
"""
from __future__ import annotations

import math
from typing import Iterable, Tuple

from torch import Tensor

__all__ = ["kl_clip_scale"]


def kl_clip_scale(pairs: Iterable[Tuple[Tensor, Tensor]], lr: float, kl_clip: float) -> float:
    """``ν`` for ``pairs`` of ``(preconditioned, raw)`` gradient matrices of the layers.

    The sum is accumulated in Python floats (double precision), layer by layer.
    """
    vg_sum = 0.0
    for precond, grad in pairs:
        vg_sum += float((precond.double() * grad.double()).sum()) * lr ** 2
    if vg_sum == 0.0 or not math.isfinite(vg_sum):
        return 1.0
    return min(1.0, math.sqrt(kl_clip / abs(vg_sum)))
