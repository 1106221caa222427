"""The KL clip of a preconditioned update and its finiteness check in one pass (SecondOrderOptimizer's
plain step, run at every step).

:func:`torchsso2.optim.steps.kl_clip_factor` followed by a scaled copy of every update and a finite
check of the copies costs three passes over the updates (digits MLP at batch 128: about 60 µs of a
0.63 ms step). Here:

* ``vg = Σ_p lr_p² u_pᵀd_p`` is one ``torch.dot`` per tensor (not a product and a sum);
* a finite ``vg`` proves every update finite (a non-finite element of ``u_p`` makes its term, and
  the sum, inf or NaN — whatever ``d`` or ``lr`` is), so the separate check runs only when ``vg`` is
  not finite (a bad update, or finite terms overflowing: then the updates are checked one by one,
  and finite ones get ``vg`` summed again in float64; a ``vg`` beyond float64 skips the step);
* ``ν = 1`` (the clip not binding) leaves the updates as they are; otherwise one
  ``torch._foreach_mul`` scales them (new tensors: an update may be ``p.grad`` itself).

Same numbers as the three passes up to the summation order of ``vg`` (float rounding of ``ν``).
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from curvature.blocks.base import owned_all_finite

from .steps import kl_clip_scale, kl_sum_float64


def _inner(u: Tensor, d: Tensor) -> float:
    """``uᵀd`` of two same-shaped tensors as a Python float."""
    if u.dtype == d.dtype and u.dim() and u.is_contiguous() and d.is_contiguous():
        return float(torch.dot(u.view(-1), d.view(-1)))
    return float((u * d).sum())


def clip_scale(updates: Sequence[Tensor], vecs: Sequence[Tensor], lrs: Sequence[float],
               kl_clip: float) -> Optional[float]:
    """The clip's ``ν = min(1, sqrt(kl_clip / Σ_p lr_p² u_pᵀd_p))`` (1 when the sum is <= 0), or
    None when some update is not finite; the updates are not scaled (:func:`clip_and_check` scales
    them; SecondOrderOptimizer folds ``ν`` into its fused momentum step,
    :mod:`torchsso2.optim.fused_momentum`). Arguments as :func:`clip_and_check`'s."""
    vg = 0.0
    for r, u, d in zip(lrs, updates, vecs):  # a plain loop: this runs at every step
        vg += r * r * _inner(u, d)
    if not math.isfinite(vg):
        if not owned_all_finite(list(updates)):
            return None
        # finite updates whose products overflow the working precision: the sum again in float64;
        # beyond float64 too, the step is not usable (skipped like a non-finite one)
        vg = kl_sum_float64(updates, vecs, lrs)
        if not math.isfinite(vg):
            return None
    return kl_clip_scale(vg, kl_clip)


def clip_and_check(updates: Sequence[Tensor], vecs: Sequence[Tensor], lrs: Sequence[float],
                   kl_clip: float) -> Optional[List[Tensor]]:
    """The updates scaled by ``ν = min(1, sqrt(kl_clip / Σ_p lr_p² u_pᵀd_p))`` (1 when the sum is
    <= 0), or None when some update is not finite.

    Args:
        updates: the preconditioned updates ``u_p`` (any shapes).
        vecs: the vectors they precondition ``d_p`` (gradient plus weight decay), shaped as ``updates``.
        lrs: one learning rate per tensor.
        kl_clip: the clip (> 0).
    """
    nu = clip_scale(updates, vecs, lrs, kl_clip)
    if nu is None:
        return None
    if nu == 1.0:
        return list(updates)
    return list(torch._foreach_mul(list(updates), nu))
