"""The small pure steps that an optimizer ``step()`` composes (optax-style).

Each function maps lists of parameter-shaped tensors to new lists; none mutates its inputs
except where the name ends in ``_``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple, Union

import torch

from torch import Tensor

from curvature.blocks import Block


def add_weight_decay(grads: Sequence[Tensor], params: Sequence[Tensor], weight_decay: float) -> List[Tensor]:
    """``g + weight_decay·θ``."""
    if weight_decay == 0.0:
        return list(grads)
    return [g + weight_decay * p.detach() for g, p in zip(grads, params)]


def precondition(blocks: Dict[str, Block], grads: Dict[int, Tensor]) -> Dict[int, Tensor]:
    """Replace the gradient of every covered parameter by ``(scale·C + damping·I)⁻¹ g`` (per block).

    ``grads`` maps ``id(param)`` to its gradient; parameters not in any block pass through.
    """
    out = dict(grads)
    for blk in blocks.values():
        params = blk.layout.params
        solved = blk.solve([grads[id(p)] for p in params])
        for p, s in zip(params, solved):
            out[id(p)] = s
    return out


def kl_clip_factor(updates: Sequence[Tensor], grads: Sequence[Tensor], lr: Union[float, Sequence[float]],
                   kl_clip: float) -> float:
    """kfac_pytorch's KL clip: ``ν = min(1, sqrt(kl_clip / Σ_p lr_p² u_pᵀg_p))`` (1 when the sum is <= 0).

    With one learning rate this is ``min(1, sqrt(kl_clip / (lr² Σ uᵀg)))``; ``lr`` may also be
    one value per tensor (param groups with different learning rates).
    """
    lrs = [float(lr)] * len(updates) if isinstance(lr, (int, float)) else [float(x) for x in lr]
    vg = sum(r * r * float((u * g).sum()) for r, u, g in zip(lrs, updates, grads))
    if vg <= 0:
        return 1.0
    return min(1.0, math.sqrt(kl_clip / vg))


def momentum_(state: Dict[str, Any], update: Tensor, momentum: float) -> Tensor:
    """``buf ← momentum·buf + u`` in ``state["momentum_buffer"]`` (a copy of ``u`` on first use);
    returns the buffer, or ``u`` itself when ``momentum`` is 0 (no buffer is kept)."""
    if momentum == 0.0:
        return update
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = update.detach().clone()
    else:
        buf.mul_(momentum).add_(update)
    return buf


def momentum_buffers_(updates: Sequence[Tensor], states: Sequence[Dict[str, Any]],
                      momentums: Sequence[float]) -> List[Tensor]:
    """:func:`momentum_` for every tensor: the buffers (or the updates, where momentum is 0).

    Existing buffers are updated with ``torch._foreach_*`` ops per momentum value (as
    ``torch.optim.SGD`` does); a buffer's first use and momentum 0 go through :func:`momentum_`.
    """
    directions: List[Tensor] = []
    scaled: Dict[float, Tuple[List[Tensor], List[Tensor]]] = {}
    for u, state, mom in zip(updates, states, momentums):
        buf = state.get("momentum_buffer")
        if mom == 0.0 or buf is None:  # no buffer kept, or its first use: momentum_ itself
            directions.append(momentum_(state, u, mom))
        else:
            bufs, news = scaled.setdefault(mom, ([], []))
            bufs.append(buf)
            news.append(u)
            directions.append(buf)
    for mom, (bufs, news) in scaled.items():
        torch._foreach_mul_(bufs, mom)
        torch._foreach_add_(bufs, news)
    return directions


def add_scaled_(params: Sequence[Tensor], directions: Sequence[Tensor], lrs: Sequence[float]) -> None:
    """``θ ← θ − lr·d`` for every parameter, one ``torch._foreach_add_`` per learning rate."""
    steps: Dict[float, Tuple[List[Tensor], List[Tensor]]] = {}
    for p, d, lr in zip(params, directions, lrs):
        ps, ds = steps.setdefault(lr, ([], []))
        ps.append(p)
        ds.append(d)
    for lr, (ps, ds) in steps.items():
        torch._foreach_add_(ps, ds, alpha=-lr)


def momentum_step_(params: Sequence[Tensor], updates: Sequence[Tensor], states: Sequence[Dict[str, Any]],
                   lrs: Sequence[float], momentums: Sequence[float]) -> None:
    """``θ ← θ − lr·momentum_(state, u, momentum)`` for every parameter, in place.

    The same arithmetic as :func:`momentum_` followed by ``p.add_(buf, alpha=-lr)``, batched with
    ``torch._foreach_*`` ops per momentum value and per learning rate (as ``torch.optim.SGD``
    does): on a small model a step is mostly per-op overhead (digits MLP: 29 → 21 µs).
    """
    add_scaled_(params, momentum_buffers_(updates, states, momentums), lrs)
