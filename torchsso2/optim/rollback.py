"""The running curvature as it was before a step folded its batch in, to put back if the step raises
after that (adaptive mode's forward-mode pass: a model op without a forward-mode formula, a
``KeyboardInterrupt``), so that training on is as if the call never happened.

Held for one step: the statistics of the blocks the step's EMA writes in place (clones), every
block's decomposition (the dicts: a decomposition is replaced, never written in place), the block
set, the update count, whether a decomposition exists (or is pending after a damping change), the damping
and the LM rule's state with the skip counts (a failed decomposition raises the damping and counts a skip
inside the step), and with several processes the work assignment the decompositions were placed by. The
blocks' derived caches follow their sources' versions (:class:`curvature.blocks.base.DerivedCache`), so they
rebuild after the restore.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from torch import Tensor

from curvature.blocks import Block

from .skips import NonFiniteError

__all__ = ["CurvatureRollback"]


class CurvatureRollback:
    """What :meth:`restore` puts back into optimizer ``opt``'s running curvature; ``statistics``: whether
    this step updates the statistics (then they are cloned; else only references are kept)."""

    def __init__(self, opt: Any, statistics: bool) -> None:
        self.blocks: Dict[str, Tuple[Block, Optional[List[Tensor]], Any]] = {
            name: (blk, [t.clone() for t in blk.tensors()] if statistics else None, blk.decomposition)
            for name, blk in opt.running.blocks.items()}
        self.num_updates = opt.running.num_updates
        self.decomposed = opt._decomposed
        self.redamp_pending = opt._redamp_pending
        # the damping and the LM rule's state: a failed decomposition raises them inside the step
        self.damping = opt.__dict__.get("_damping")
        self.extra = opt._extra_snapshot()
        self.skips = (opt.num_skipped, opt._streak.count, opt.__dict__.get("_skip_counted", False))
        # with several processes, where the decompositions put back sit (a new block placed all of them anew)
        self.assignment = opt.placement.assignment

    def restore(self, opt: Any, error: Optional[BaseException] = None) -> None:
        """Put the curvature back; ``error``: what interrupted the step. The skip policy's own
        :class:`~torchsso2.optim.skips.NonFiniteError` (a stall at ``max_consecutive_skips``) keeps what the
        policy recorded of the failure: the skip counts it reports and the damping it raised."""
        blocks: Dict[str, Block] = {}
        for name, (blk, saved, decomposition) in self.blocks.items():
            if saved is not None:
                for t, s in zip(blk.tensors(), saved):
                    t.copy_(s)
            blk.decomposition = decomposition
            blocks[name] = blk
        opt.running.blocks = blocks
        opt.running.num_updates = self.num_updates
        opt._decomposed = self.decomposed
        opt._redamp_pending = self.redamp_pending
        opt.placement.assignment = self.assignment
        if isinstance(error, NonFiniteError):
            return
        if self.damping is not None:
            opt._damping = self.damping
        opt._restore_extra(self.extra)
        opt.num_skipped, opt._streak.count, opt._skip_counted = self.skips
