"""Move the damping of the current K-FAC eigen decompositions without decomposing again.

A K-FAC block decomposed with ``method="eigen"`` holds ``Q_L``, ``Q_R`` and
``denom = scale·λ_L λ_Rᵀ + damping`` (curvature/blocks/kfac.py): a new damping changes only
``denom``, by the change of the damping. When the Levenberg–Marquardt rule changes the damping
between two scheduled decompositions (``inv_update_interval``), this keeps the decomposition
of the factors as they were at the last one and gives it the new damping, as kfac-jax does (its
cached eigenbases take the current damping when they are applied), instead of decomposing the
factors again at the next step. With a curvature estimate every few steps and the LM rule every
``damping_adaptation_interval`` steps, the latter made every damping change a full
re-decomposition of freshly estimated factors (at intervals 5/50 and LM every 5 steps: a
decomposition every 5 steps, not every 50).
"""
from __future__ import annotations

from typing import Callable, Collection, Mapping, Optional

import torch
from torch import Tensor

from curvature.blocks import Block, KFACBlock
from curvature.blocks.base import roundoff_damping
from curvature.linalg.checks import coarsest_eps


def redamp(blocks: Mapping[str, Block], old: float, new: float,
           agree: Optional[Callable[[bool], bool]] = None, held: Optional[Collection[str]] = None) -> bool:
    """Give every block's decomposition the damping ``new`` in place of ``old``; all or nothing.

    Returns True when every block is a K-FAC block with an eigen decomposition and the new
    ``denom`` is positive everywhere (the decompositions are then replaced, not written into: a saved
    ``state_dict`` is untouched); False, with nothing changed, otherwise (the caller then decomposes
    again). The damping a decomposition added is ``max(damping, eps·P)`` with ``P`` the largest
    ``scale·λ_L λ_R`` (:func:`curvature.blocks.base.roundoff_damping`), so ``denom`` changes by the
    difference of the two added dampings: the same ``denom`` as a decomposition at ``new``, to rounding.

    ``agree``, ``held``: with several processes (KAISA placement), where a rank holds the decompositions of
    the blocks ``held`` (those it is a grad worker of; the others are None there): ``agree`` is told whether
    this rank's can be re-damped (each an eigen decomposition, the new ``denom`` positive) and returns
    whether every rank's can (one all-reduce, reached on every rank whatever it holds: the same answer
    everywhere)."""
    blks = list(blocks.values())
    if not blks or not all(isinstance(b, KFACBlock) for b in blks):  # the same on every rank
        return False
    mine = blks if agree is None else [blocks[n] for n in (held if held is not None else blocks)]
    ok = all(b.decomposition is not None and b.decomposition.get("method") == "eigen" for b in mine)
    denoms = [_redamped(b, old, new) for b in mine] if ok else []
    ok = ok and all(bool((d > 0).all()) for d in denoms)
    if agree is not None:
        ok = agree(ok)
    if not ok:
        return False
    for b, d in zip(mine, denoms):
        b.decomposition = {**b.decomposition, "denom": d}  # type: ignore[dict-item]
    return True


def _redamped(block: KFACBlock, old: float, new: float) -> Tensor:
    """``denom`` of ``block``'s eigen decomposition at damping ``old``, moved to ``new`` (a new tensor).
    ``P`` comes from ``denom`` itself: its largest entry is ``P + max(old, eps·P)`` (``P`` + 0 at damping
    0, which adds no round-off), so every rank derives the same from the same decomposition."""
    denom = block.decomposition["denom"]  # type: ignore[index]
    if not denom.numel():
        return denom + (new - old)
    eps = coarsest_eps(denom.dtype, block.left.dtype, block.right.dtype)
    top = denom.max()
    if old > 0:
        above = top - old  # P where the damping was above the round-off, else top / (1 + eps)
        largest = torch.where(above * eps <= old, above, top / (1 + eps))
    else:
        largest = top
    return denom + (roundoff_damping(new, largest, eps) - roundoff_damping(old, largest, eps))
