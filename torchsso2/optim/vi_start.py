"""How :class:`VIOptimizer` starts and bounds its steps (IVON's ``hess_init`` and ``clip_radius``).

* :func:`isotropic_blocks` — blocks shaped like a batch's fresh blocks whose dense curvature is
  ``value·I``: the curvature EMA starts there instead of at the first batch's estimate
  (Shen et al. 2024, IVON's ``hess_init``). A one-batch estimate (one sampled label per
  example) has many near-zero entries, so ``Λ = N·C + τδ`` starts near ``τδ`` in those
  directions: the first mean steps ``lr·Λ⁻¹·N·m`` are ``N/(τδ)`` times the gradient there and
  the first weight samples have the prior's width. Starting at ``value·I`` gives
  ``Λ₀ = N·value + τδ``: small first samples (std ``1/√(N·value)``) and first steps of about
  ``lr·m/value``, SGD-like; the slow EMA then moves ``C`` towards the data's curvature.
* :func:`clip_` — IVON's ``clip_radius``: each coordinate of the preconditioned step is
  clipped to ``[-radius, radius]`` before it is scaled by ``lr``.
* :func:`debias_factor` — IVON's (and Adam's) momentum bias correction: the momentum buffer
  ``m_t = Σ_k β^k g_{t−k}`` of step ``t`` holds ``(1 − β^t)/(1 − β)`` times a constant gradient, so
  the first steps are up to ``1/(1 − β)`` (10 at β = 0.9) times shorter than the later ones; the
  step's lr multiplied by ``1/(1 − β^t)`` makes every step as long as the steady state's.
"""
from __future__ import annotations

import copy
from typing import Dict, List

import torch
from torch import Tensor

from curvature.blocks import Block
from curvature.blocks.base import DerivedCache

__all__ = ["isotropic_blocks", "clip_", "debias_factor"]


def isotropic_blocks(like: Dict[str, Block], value: float) -> Dict[str, Block]:
    """Blocks of the types and layouts of ``like`` whose dense form is ``value·I``.

    Each of a block's ``k`` statistics becomes ``value^(1/k)`` times an identity (a matrix
    statistic) or a vector of ones (a diagonal one): a diagonal block holds ``value·1``, a full
    block ``value·I``, a K-FAC block ``√value·I ⊗ √value·I``. ``like`` is not changed.
    """
    out: Dict[str, Block] = {}
    for name, blk in like.items():
        stats = blk.tensors()
        scale = float(value) ** (1.0 / len(stats))
        own = copy.copy(blk)
        own.__dict__.update({k: DerivedCache() for k, v in vars(blk).items() if isinstance(v, DerivedCache)})
        own.decomposition = None
        fresh: List[Tensor] = []
        for t, sym in zip(stats, blk.symmetric()):
            if sym:
                fresh.append(torch.eye(t.shape[0], dtype=t.dtype, device=t.device).mul_(scale))
            else:
                fresh.append(torch.full_like(t, scale))
        for key, v in vars(blk).items():  # replace each statistic tensor attribute by its identity
            if isinstance(v, Tensor):
                for i, t in enumerate(stats):
                    if v is t:
                        setattr(own, key, fresh[i])
        assert all(a is b for a, b in zip(own.tensors(), fresh)), f"block {name!r}: statistics not replaced"
        out[name] = own
    return out


def clip_(steps: List[Tensor], radius: float) -> None:
    """Clip every coordinate of ``steps`` to ``[-radius, radius]``, in place (``radius = inf``: no-op)."""
    if radius != float("inf") and steps:
        for s in steps:
            s.clamp_(-radius, radius)


def debias_factor(momentum: float, step: int) -> float:
    """``1/(1 − momentum^step)``: the lr factor that removes the momentum buffer's start-up bias at step
    ``step`` (``>= 1``, the number of gradients folded into the buffer); 1 for ``momentum`` 0."""
    if step < 1:
        raise ValueError(f"debias_factor needs step >= 1 (gradients in the momentum buffer), got {step}")
    if momentum == 0.0:
        return 1.0
    return 1.0 / (1.0 - float(momentum) ** step)
