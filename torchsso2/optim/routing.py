"""Covered modules that part of a step's batch did not go through (conditional computation: a
mixture-of-experts expert, LayerDrop, a head some micro-batches or ranks use).

A fresh block is a mean over the examples of its batch, and an example that does not go through a module
adds nothing to that module's curvature (its gradient with respect to the module's parameters is zero).
So where several parts of a batch are averaged — the micro-batches or weight samples of one closure
(:class:`~torchsso2.optim.base.BlockAverage`) or the ranks of a data-parallel step
(:meth:`~torchsso2.optim.base.CurvatureOptimizer._average_over_ranks`) — a part that did not call a
module counts as a zero block, with its weight. The exception is K-FAC's input-side factor ``A``, a mean
over the rows the module itself saw: it is averaged weighted by those rows (:attr:`KFACBlock.rows`), zero
where a part did not call the module. Both give one process's blocks on the whole batch, its examples
routed as they were. A module no part called is left out of the step's estimate and keeps its running
curvature, as in one process. (A tied layout's K-FAC left factor sums its uses' factors, ``A`` of one and
``G`` of another: it is averaged over the parts that called the module, not weighted by rows.)
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import Tensor

from curvature.blocks import Block, DiagBlock, FullBlock, KFACBlock
from curvature.blocks.base import compute_dtype
from curvature.blocks.layout import Layout, kfac_dims, kfac_left_is_diagonal
from curvature.options import Approx


def scale_to_whole_batch(block: Block, share: float) -> None:
    """``block``, averaged over the parts of the batch that called its module, times ``share`` (their
    part of the batch's weight) in place: the mean over the whole batch with zeros from the other parts.
    K-FAC's ``A`` is left as it is (the mean over the rows the module saw, :func:`fold`)."""
    if share == 1.0:
        return
    keep = block.A if isinstance(block, KFACBlock) else None
    for t in block.tensors():
        if t is not keep:
            t.mul_(share)


def zero_block(layout: Layout, approx: Approx) -> Block:
    """A block of zeros for ``layout`` in shape ``approx``, with the statistics' shapes and dtype of an
    estimated one (K-FAC's left factor a diagonal ``[r]`` where every use's family stores it so, as
    Embedding's ``A``), and no rows."""
    ref = layout.params[0]
    opts = dict(dtype=compute_dtype(ref.dtype), device=ref.device)
    if approx is Approx.DIAG:
        return DiagBlock(layout, torch.zeros(layout.numel, **opts))
    if approx is Approx.FULL:
        return FullBlock(layout, torch.zeros(layout.numel, layout.numel, **opts))
    r, c = kfac_dims(layout)
    block = KFACBlock(layout, torch.zeros((r,) if kfac_left_is_diagonal(layout) else (r, r), **opts),
                      torch.zeros(c, c, **opts))
    block.rows = 0.0
    return block


def fold(mine: Block, new: Block, weight: float, added: float) -> None:
    """``mine`` (of weight ``weight``) := the weighted mean of ``mine`` and ``new`` (of weight ``added``), in
    place; K-FAC's ``A`` weighted by the rows each averages when both know them (numbers or 0-dim tensors)."""
    total = weight + added
    by_rows = isinstance(mine, KFACBlock) and isinstance(new, KFACBlock) and \
        mine.rows is not None and new.rows is not None
    keep = mine.A if by_rows else None
    for t, fresh in zip(mine.tensors(), new.tensors()):
        if t is not keep:
            t.mul_(weight / total).add_(fresh, alpha=added / total)
            continue
        rows = mine.rows + new.rows
        if isinstance(rows, Tensor):  # (no host sync; rows 0 on both sides keeps the zero factor)
            share = torch.as_tensor(new.rows, dtype=t.dtype, device=t.device) / rows.to(t.dtype).clamp_min(1e-30)
            t.mul_(1 - share).add_(fresh * share)
        elif rows > 0:
            t.mul_(mine.rows / rows).add_(fresh, alpha=new.rows / rows)
        mine.rows = rows


def presence(order: Sequence[str], blocks: Dict[str, Block]) -> List[float]:
    """1.0 for each module of ``order`` with a block in ``blocks``, else 0.0 (averaged over the ranks: > 0
    where some rank called it)."""
    return [1.0 if name in blocks else 0.0 for name in order]


def fill_absent(blocks: Dict[str, Block], called: Sequence[str], layouts: Dict[str, Layout],
                approx: Dict[str, Approx]) -> None:
    """Before the ranks' mean: ``blocks`` := the modules some rank called (``called``, in an order every rank
    holds alike: the mean pairs the blocks by position), in place, with a zero block (no rows) for each
    this rank did not call."""
    ordered = {name: blocks[name] if name in blocks else zero_block(layouts[name], approx[name]) for name in called}
    blocks.clear()
    blocks.update(ordered)


def weigh_inputs(blocks: Dict[str, Block]) -> List[Tensor]:
    """Before the ranks' mean of ``blocks``: each K-FAC ``A`` times the rows it averages, in place; returns
    those rows as one-element tensors, to be averaged with the blocks (:func:`unweigh_inputs`). A block
    without its rows (None) counts as one row."""
    rows = []
    for block in blocks.values():
        if isinstance(block, KFACBlock):
            n = 1.0 if block.rows is None else block.rows
            block.A.mul_(n)
            rows.append(n.reshape(1).to(block.A.dtype) if isinstance(n, Tensor) else block.A.new_full((1,), float(n)))
    return rows


def unweigh_inputs(blocks: Dict[str, Block], rows: List[Tensor]) -> None:
    """After the ranks' mean: each K-FAC ``A`` divided by its mean rows: ``Σ_r n_r A_r / Σ_r n_r``."""
    kfac = [b for b in blocks.values() if isinstance(b, KFACBlock)]
    for block, mean in zip(kfac, torch.cat(rows).tolist() if rows else []):  # (one device sync)
        if mean > 0:
            block.A.div_(mean)
        block.rows = mean

