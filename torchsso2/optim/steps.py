"""The small pure steps that an optimizer ``step()`` composes (optax-style).

Each function maps lists of parameter-shaped tensors to new lists; none mutates its inputs
except where the name ends in ``_``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from torch import Tensor

from curvature.blocks import Block, DiagBlock
from curvature.blocks.base import like_dtype

from .plan import ScalarCache, UpdatePlan


def add_weight_decay(grads: Sequence[Tensor], params: Sequence[Tensor], weight_decay: float) -> List[Tensor]:
    """``g + weight_decay·θ``."""
    if weight_decay == 0.0:
        return list(grads)
    wd = float(weight_decay)  # an int group value (10**30) is beyond torch's int scalars
    return [g + wd * p.detach() for g, p in zip(grads, params)]


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
    if not math.isfinite(vg):  # products overflowing the working precision
        vg = kl_sum_float64(updates, grads, lrs)
    return kl_clip_scale(vg, kl_clip)


def kl_sum_float64(updates: Sequence[Tensor], vecs: Sequence[Tensor], lrs: Sequence[float]) -> float:
    """``Σ_p lr_p² u_pᵀd_p`` summed in float64: the KL clip's sum again where the working precision
    overflowed (finite float32 updates of ~1e20); inf or NaN when the updates are not finite or the
    sum is beyond float64 too."""
    return sum(r * r * float((u.double() * d.double()).sum()) for r, u, d in zip(lrs, updates, vecs))


def kl_clip_scale(vg: float, kl_clip: float) -> float:
    """``ν = min(1, sqrt(kl_clip / vg))`` for ``vg = Σ_p lr_p² u_pᵀg_p`` (1 when ``vg <= 0``; 0 when
    ``vg`` is inf or NaN: an update too large to measure is not taken)."""
    if not math.isfinite(vg):
        return 0.0
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


BufferGroups = Dict[Tuple[float, torch.dtype, torch.device], Tuple[List[int], List[Tensor]]]


def _buffer_groups(states: Sequence[Dict[str, Any]], momentums: Sequence[float]) -> Tuple[List[int], BufferGroups]:
    """``(first, groups)``: the indices whose momentum is 0 or whose buffer is used for the first
    time, and the others' indices and buffers per (momentum, dtype, device) — the groups one
    ``torch._foreach_*`` op each can update (as ``torch.optim.SGD`` groups them)."""
    first: List[int] = []
    groups: BufferGroups = {}
    for i, (state, mom) in enumerate(zip(states, momentums)):
        buf = state.get("momentum_buffer")
        if mom == 0.0 or buf is None:
            first.append(i)
        else:
            idx, bufs = groups.setdefault((mom, buf.dtype, buf.device), ([], []))
            idx.append(i)
            bufs.append(buf)
    return first, groups


def _decay_(bufs: List[Tensor], momentum: float, scalars: Optional[ScalarCache]) -> None:
    """``buf ← momentum·buf`` for every buffer (the factor as a cached 0-dim tensor with ``scalars``)."""
    torch._foreach_mul_(bufs, momentum if scalars is None else scalars.get(momentum, bufs[0]))


def momentum_buffers_(updates: Sequence[Tensor], states: Sequence[Dict[str, Any]],
                      momentums: Sequence[float], scalars: Optional[ScalarCache] = None) -> List[Tensor]:
    """:func:`momentum_` for every tensor: the buffers (or the updates, where momentum is 0).

    Existing buffers are updated with ``torch._foreach_*`` ops per momentum value, dtype and
    device (as ``torch.optim.SGD`` does); a buffer's first use and momentum 0 go through
    :func:`momentum_`. ``scalars`` (kept by the optimizer) passes the momentum as a cached 0-dim
    tensor: same numbers, 5 µs less per call on CPU.
    """
    first, groups = _buffer_groups(states, momentums)
    directions: List[Tensor] = list(updates)
    for i in first:  # no buffer kept, or its first use: momentum_ itself
        directions[i] = momentum_(states[i], updates[i], momentums[i])
    for (mom, _, _), (idx, bufs) in groups.items():
        _decay_(bufs, mom, scalars)
        torch._foreach_add_(bufs, [updates[i] for i in idx])
        for i, b in zip(idx, bufs):
            directions[i] = b
    return directions


#: dtypes for which ``torch._fused_sgd_`` computes SGD's momentum update as the public ops do
#: (tests/test_half_precision.py); on CPU it is wrong in float16 (off by up to 18 on values of
#: order 1) and bfloat16, which take the ``torch._foreach_*`` ops instead
FUSED_SGD_DTYPES = (torch.float32, torch.float64)


def natural_momentum_(states: Sequence[Dict[str, Any]], grads: Sequence[Tensor], means: Sequence[Tensor],
                      prior: float, momentums: Sequence[float]) -> List[Tensor]:
    """VI's momentum of the mean-loss gradient plus the prior term, ``m ← momentum·m + (g + prior·μ)``
    in ``state["momentum_buffer"]`` (``prior = τδ/N``); returns the buffers (or ``g + prior·μ``
    itself where momentum is 0).

    Existing float32/float64 buffers (:data:`FUSED_SGD_DTYPES`) take one fused kernel per
    (momentum, dtype, device): ``torch._fused_sgd_``,
    SGD's own (``torch.optim.SGD(fused=True)``), with weight decay ``prior`` and learning rate 0 —
    its momentum update is exactly this one, and with no ``grad_scale`` it leaves the gradients as
    they are. On CPU, the digits MLP's four tensors: 3.3 µs against 10 for the three
    ``torch._foreach_*`` ops it replaces. A buffer's first use and momentum 0 compute
    ``g + prior·μ`` out of place."""
    first, groups = _buffer_groups(states, momentums)
    out: List[Tensor] = list(grads)
    for i in first:
        raw = grads[i].clone() if not prior else torch.add(grads[i], means[i], alpha=prior)
        out[i] = momentum_(states[i], raw, momentums[i])
    for (mom, dtype, _), (idx, bufs) in groups.items():
        if dtype in FUSED_SGD_DTYPES:
            torch._fused_sgd_([means[i] for i in idx], [grads[i] for i in idx], bufs, weight_decay=prior,
                              momentum=mom, lr=0.0, dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
        else:  # the public ops: the fused kernel is wrong in half precision
            _decay_(bufs, mom, None)
            torch._foreach_add_(bufs, [torch.add(grads[i], means[i], alpha=prior) if prior else grads[i] for i in idx])
        for i, b in zip(idx, bufs):
            out[i] = b
    return out


def add_scaled_(params: Sequence[Tensor], directions: Sequence[Tensor], lrs: Sequence[float]) -> None:
    """``θ ← θ − lr·d`` for every parameter, one ``torch._foreach_add_`` per learning rate."""
    if lrs and lrs.count(lrs[0]) == len(lrs):  # one learning rate (the common case): no grouping
        torch._foreach_add_(list(params), list(directions), alpha=-lrs[0])
        return
    steps: Dict[float, Tuple[List[Tensor], List[Tensor]]] = {}
    for p, d, lr in zip(params, directions, lrs):
        ps, ds = steps.setdefault(lr, ([], []))
        ps.append(p)
        ds.append(d)
    for lr, (ps, ds) in steps.items():
        torch._foreach_add_(ps, ds, alpha=-lr)


def momentum_step_(params: Sequence[Tensor], updates: Sequence[Tensor], states: Sequence[Dict[str, Any]],
                   lrs: Sequence[float], momentums: Sequence[float], scalars: Optional[ScalarCache] = None) -> None:
    """``θ ← θ − lr·momentum_(state, u, momentum)`` for every parameter, in place.

    The same arithmetic as :func:`momentum_` followed by ``p.add_(buf, alpha=-lr)``, batched with
    ``torch._foreach_*`` ops per momentum value and per learning rate (as ``torch.optim.SGD``
    does): on a small model a step is mostly per-op overhead (digits MLP: 29 → 21 µs).
    """
    add_scaled_(params, momentum_buffers_(updates, states, momentums, scalars), lrs)


def _same_dtypes(xs: Sequence[Tensor], ys: Sequence[Tensor]) -> bool:
    for x, y in zip(xs, ys):  # a plain loop: this runs on every step
        if x.dtype != y.dtype:
            return False
    return True


def preconditioned_descent_(plan: UpdatePlan, params: Sequence[Tensor], vecs: Sequence[Tensor],
                            lrs: Sequence[float], block_scale: float, other_scale: float) -> None:
    """``θ_i ← θ_i − lr_i·block_scale·(C⁻¹v)_i`` where ``params[i]`` is in one of ``plan``'s blocks
    (``C⁻¹`` its ``solve``), ``θ_i ← θ_i − lr_i·other_scale·v_i`` elsewhere; in place (``params[i]``
    and ``vecs[i]`` of one shape, the positions of ``plan``).

    With one learning rate (the common case) the diagonal blocks whose dtypes match take one fused
    ``torch._foreach_addcmul_`` (``v ⊙ 1/denom`` and the add in one pass, no temporary), every other
    block one ``torch._foreach_add_`` of its solve. With several, each solve is added per learning rate.
    """
    lr = lrs[0] if lrs else 0.0
    if list(lrs).count(lr) != len(lrs):
        steps = [like_dtype(d * block_scale if inside else v * other_scale, p) for d, v, inside, p
                 in zip(plan.precondition(vecs), vecs, plan.in_block, params)]
        add_scaled_(params, steps, lrs)
        return
    targets: List[Tensor] = []
    factors: List[Tensor] = []
    inverses: List[Tensor] = []
    for blk, pos in plan.blocks:
        if isinstance(blk, DiagBlock):
            inv = blk.inverse_diagonal()
            if _same_dtypes([params[i] for i in pos], inv):
                targets.extend(params[i] for i in pos)
                factors.extend(vecs[i] for i in pos)
                inverses.extend(inv)
                continue
        solved = blk.solve([vecs[i] for i in pos])
        torch._foreach_add_([params[i] for i in pos], [like_dtype(s, params[i]) for i, s in zip(pos, solved)],
                            alpha=-lr * block_scale)
    if targets:
        torch._foreach_addcmul_(targets, factors, inverses, value=-lr * block_scale)
    if plan.others:
        torch._foreach_add_([params[i] for i in plan.others], [vecs[i] for i in plan.others], alpha=-lr * other_scale)
