"""The curvature of the forwards of one closure that its loss uses.

A closure may run the model several times: micro-batches (gradient accumulation) and augmented views
whose losses are combined are averaged, weighted by their rows (:class:`~torchsso2.optim.base.BlockAverage`).
A forward whose output no backward of the closure reaches, run with gradients on (pseudo-labels from
``model(x_unlabeled).argmax(-1)``, a metric), is not part of the objective: its curvature is left out.
Which forwards the user's backward reached is seen by a gradient hook on each output's tensors,
registered after the engine's own backward passes on it (those do not count). Until the closure ends a
forward's blocks are kept apart; one the backward has reached is folded into the average at the next
forward already (gradient accumulation, forward and backward alternating, keeps one set of blocks). If
no forward was reached (a loss computed outside the recorded outputs), every forward counts, as before.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from torch import Tensor
from torch.utils._pytree import tree_leaves

logger = logging.getLogger(__name__)


class _Forward:
    """One forward: its blocks (None: its output was not finite), rows, and whether a backward reached it."""

    def __init__(self, blocks: Optional[Dict[str, Any]], rows: int, output: Any) -> None:
        self.blocks = blocks
        self.rows = rows
        self.reached = False
        leaves = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
        self.handles = [t.register_hook(self._mark) for t in leaves]

    def _mark(self, grad: Tensor) -> None:
        self.reached = True

    def unhook(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class UsedForwards:
    """Collects each forward's blocks for ``average`` (a ``BlockAverage``); see the module docstring."""

    def __init__(self, average: Any) -> None:
        self.average = average
        self.pending: List[_Forward] = []
        self.folded = 0

    def add(self, blocks: Optional[Dict[str, Any]], rows: int, output: Any) -> None:
        """A forward's ``blocks`` (None: not finite) over ``rows`` loss rows; ``output``: the model's output
        as returned and as selected (``(raw, selected)``: a dataclass output has no tensor leaves, a selection
        may be a new tensor the loss does not use), after the engine's own backward passes on it."""
        self._fold(reached_only=True)
        self.pending.append(_Forward(blocks, rows, output))

    def finish(self) -> int:
        """After the closure: fold what the backward reached and drop the rest (all, where nothing was
        reached); the hooks are removed. Returns the number of forwards left out."""
        for f in self.pending:
            f.unhook()
        reached_any = self.folded > 0 or any(f.reached for f in self.pending)
        left_out = [f for f in self.pending if not f.reached] if reached_any else []
        self._fold(reached_only=reached_any)
        self.pending = []
        if left_out:
            logger.debug("left %d forward(s) out of the curvature: no backward of the closure reached their output",
                         len(left_out))
        return len(left_out)

    def _fold(self, reached_only: bool) -> None:
        keep = []
        for f in self.pending:
            if reached_only and not f.reached:
                keep.append(f)
                continue
            f.unhook()
            if f.blocks is None:
                self.average.nonfinite = True
            else:
                self.average.add(f.blocks, f.rows)
            self.folded += 1
        self.pending = keep
