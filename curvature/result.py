"""The result of :func:`curvature.compute`: blocks plus the dense matrix over covered parameters."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch
from torch import Tensor, nn

from .blocks import Block, Layout


@dataclass
class Curvature:
    """Per-module curvature blocks of one batch.

    Attributes:
        blocks: module name (as in ``model.named_modules()``) -> block.
        layouts: module name -> which parameters the block covers.
        kind, approx: what was computed.
    """

    blocks: Dict[str, Block]
    layouts: Dict[str, Layout]
    kind: str
    approx: Dict[str, str]

    @property
    def params(self) -> List[nn.Parameter]:
        """Covered parameters, in ``named_parameters`` order (the order of :meth:`dense`)."""
        return [p for lay in self.layouts.values() for p in lay.params]

    def dense(self) -> Tensor:
        """``[P, P]`` block-diagonal matrix over the covered parameters."""
        return torch.block_diag(*[self.blocks[n].dense() for n in self.layouts])
