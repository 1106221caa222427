"""Diagonal curvature from the gradient of the weight sample (IVON's reparameterisation estimator).

With weights ``θ = μ + ε``, ``ε ~ N(0, diag(σ²))``, Stein's lemma gives
``E[g(θ)·ε/σ²] = E[diag ∇²ℓ(θ)]`` coordinate by coordinate (``g`` the gradient of the mean loss
at the sample), so

    ĥ = g ⊙ ε / σ²                                  (shapes: those of the parameters)

is an unbiased estimate of the expected Hessian diagonal that needs nothing but the backward
the step runs anyway (Shen et al. 2024, "Variational Learning is Effective for Large Deep
Networks", the ``price`` estimator of ``ivon-opt``). Where the loss's Hessian equals its
generalized Gauss–Newton (a model linear in its parameters) this is the GGN diagonal.

ĥ can be negative, so the running curvature is updated with IVON's Riemannian correction
(:func:`reparam_ema_`), which keeps ``C + shift > 0`` whatever ĥ is.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from .plan import ScalarCache

__all__ = ["reparam_diagonal", "reparam_ema_"]


def reparam_diagonal(grads: Sequence[Tensor], eps: Sequence[Tensor],
                     precisions: Sequence[Union[Tensor, float]]) -> List[Tensor]:
    """``ĥ = g ⊙ ε ⊙ (1/σ²)`` per parameter: ``grads`` at the sample, its noise ``eps`` and the
    noise's precisions ``1/σ²`` (tensors of the parameters' shapes, or one float each)."""
    return [g * e * p for g, e, p in zip(grads, eps, precisions)]


def reparam_ema_(running: Tensor, fresh: Tensor, decay: float, shift: float,
                 scalars: Optional[ScalarCache] = None) -> None:
    """``C ← β·C + (1 − β)·ĥ + ½(1 − β)²·(C − ĥ)² / (C + shift)`` in place (``β = decay``,
    ``shift`` = the per-example precision added to ``C``, i.e. ``(τδ + damping)/N``).

    IVON's update of its Hessian estimate: with ``x = C + shift > 0`` and
    ``d = (1 − β)(ĥ − C)/x`` the new ``C + shift`` is ``x·(½(1 + d)² + ½) > 0``.

    Computed as ``C ← C + e·((1 − β) + ½(1 − β)²·e/x)`` with ``e = ĥ − C``: the same expression
    in four ops (``running`` of a float dtype; ``fresh`` of its dtype and shape). ``scalars`` (the
    optimizer's cache of 0-dim tensors) saves building the 0-dim ``1 − β`` at every call."""
    x = running + shift
    diff = torch.sub(fresh, running)
    rate0 = scalars.get(1.0 - decay, running) if scalars is not None else None
    if not isinstance(rate0, Tensor):
        rate0 = running.new_tensor(1.0 - decay)
    rate = torch.addcdiv(rate0, diff, x, value=0.5 * (1.0 - decay) ** 2)
    running.addcmul_(diff, rate)
