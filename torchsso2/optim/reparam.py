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

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from curvature.blocks.base import compute_dtype

from .plan import ScalarCache

__all__ = ["reparam_diagonal", "reparam_ema_", "reparam_sample"]


def reparam_diagonal(grads: Sequence[Tensor], eps: Sequence[Tensor],
                     precisions: Sequence[Union[Tensor, float]]) -> List[Tensor]:
    """``ĥ = g ⊙ ε ⊙ (1/σ²)`` per parameter: ``grads`` at the sample, its noise ``eps`` and the
    noise's precisions ``1/σ²`` (tensors of the parameters' shapes, or one float each)."""
    return [g * e * p for g, e, p in zip(grads, eps, precisions)]


def reparam_ema_(running: Tensor, fresh: Tensor, decay: float, shift: float,
                 scalars: Optional[ScalarCache] = None) -> None:
    """``C ← β·C + (1 − β)·ĥ + ½(1 − β)²·(C − ĥ)² / (C + shift)`` in place (``β = decay``,
    ``shift`` = the per-example precision added to ``C``, i.e. ``(τδ + damping)·σ²/N``, ``σ²`` the noise
    variance of ``loss="mse"``, 1 otherwise: the precision is ``(N/σ²)·(C + shift)``).

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


def reparam_sample(opt: Any, noise: Optional[Tuple[Any, Any, Any]]) -> Dict[str, Tensor]:
    """``ĥ = g ⊙ ε / σ²`` of one weight sample of VIOptimizer ``opt``, ``[P_b]`` per block (``g``:
    ``p.grad`` after the sample's closure; ``ε``, ``σ²``: the sample's noise ``noise = (params, shifts,
    factors)`` and its variance ``τ/denom``, or ``1/init_precision`` before the first decomposition)."""
    if noise is None:
        raise RuntimeError("curvature='reparam' needs a weight sample at every step")
    params, shifts, factors = noise
    eps = {id(p): s if factors is None else s * f
           for p, s, f in zip(params, shifts, factors if factors is not None else shifts)}
    out: Dict[str, Tensor] = {}
    # with a grad_scaler p.grad is S·g: the precision times 1/S unscales ĥ as it is formed (S·g·ε·(1/σ²)
    # would overflow float32 long before S·g does, and the scaler would never see it and back off)
    unscale = 1.0 / float(opt.grad_scaler.get_scale()) \
        if opt.grad_scaler is not None and not opt._grads_unscaled() else 1.0
    for name, lay in opt.engine.layouts.items():
        sampled = [id(p) in eps for p in lay.params]
        if not any(sampled):  # frozen (not sampled): its curvature is kept
            continue
        if opt._decomposed:
            prec = lay.unflatten(opt.running.blocks[name].decomposition["denom"] * (unscale / opt.kl_weighting))
        else:
            prec = [float(opt._first_precision) * unscale] * len(lay.params)  # type: ignore[arg-type]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in lay.params]
        hat = reparam_diagonal([g.detach() for g, s in zip(grads, sampled) if s],
                               [eps[id(p)] for p, s in zip(lay.params, sampled) if s],
                               [q for q, s in zip(prec, sampled) if s])
        if not all(sampled):  # a frozen weight beside a trainable bias: its entries keep their running value
            kept, fresh = _current_curvature(opt, name, lay), iter(hat)
            # in the running diagonal's dtype: a half-precision copy of the kept entries would move them
            hat = [next(fresh).to(kept[i].dtype) if s else kept[i] for i, s in enumerate(sampled)]
        out[name] = torch.cat([h.reshape(-1) for h in hat])
    return out


def _current_curvature(opt: Any, name: str, lay: Any) -> List[Tensor]:
    """The running diagonal of block ``name`` per parameter (``curvature_init`` before the block exists)."""
    blk = opt.running.blocks.get(name)
    if blk is not None:
        return list(lay.unflatten(blk.diagonal))
    return [torch.full_like(p, float(opt.curvature_init), dtype=compute_dtype(p.dtype)) for p in lay.params]
