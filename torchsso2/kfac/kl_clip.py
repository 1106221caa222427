"""KL clipping of the preconditioned gradient (Ba et al. 2017; kfac_pytorch's ``kl_clip``).

With ``p`` the preconditioned and ``g`` the raw gradient of every registered layer, the
step ``-lr·p`` changes the model's output distribution by about ``½·lr²·Σ pᵀ F p ≈ ½·lr²·Σ pᵀ g``
(``F p ≈ g``). All preconditioned gradients are multiplied by

    ν = min(1, sqrt(kl_clip / |lr² · Σ_layers Σ p ⊙ g|))      (ν = 1 when the sum is 0)

so that this estimate stays below ``kl_clip``.
"""
from __future__ import annotations

import math
import sys
from typing import Iterable, Tuple

from torch import Tensor

__all__ = ["kl_clip_scale"]


#: the largest |lr| whose square is a finite double (``lr ** 2`` raises OverflowError beyond it)
_LARGEST_SQUARABLE = math.sqrt(sys.float_info.max)


def kl_clip_scale(pairs: Iterable[Tuple[Tensor, Tensor]], lr: float, kl_clip: float) -> float:
    """``ν`` for ``pairs`` of ``(preconditioned, raw)`` gradient matrices of the layers.

    The sum is accumulated in Python floats (double precision), layer by layer.
    """
    pairs = list(pairs)
    lr2 = lr * lr if abs(lr) > _LARGEST_SQUARABLE else lr ** 2  # (inf, not OverflowError, past 1.3e154)
    vg_sum = 0.0
    for precond, grad in pairs:
        vg_sum += float((precond.double() * grad.double()).sum()) * lr2
    if math.isfinite(vg_sum):
        return 1.0 if vg_sum == 0.0 else min(1.0, math.sqrt(kl_clip / abs(vg_sum)))
    # lr²·Σ vᵀg overflows a double (a huge lr or product): ν = √(kl_clip / |Σ vᵀg|) / |lr| from the unscaled sum
    raw = sum(float((precond.double() * grad.double()).sum()) for precond, grad in pairs)
    if math.isnan(raw) or raw == 0.0:
        return 1.0  # (a NaN gradient: the non-finite checks skip the step)
    return 0.0 if math.isinf(raw) else min(1.0, math.sqrt(kl_clip / abs(raw)) / abs(lr))
