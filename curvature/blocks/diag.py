"""Diagonal block: the exact diagonal ``[P]`` of one module's curvature block."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from .base import Block, check_positive, compute_dtype
from .layout import Layout


class DiagBlock(Block):
    """``diag(C)`` stored as ``[P]``; the damped inverse is elementwise."""

    approx = "diag"

    def __init__(self, layout: Layout, diagonal: Tensor) -> None:
        super().__init__(layout)
        self.diagonal = diagonal.to(compute_dtype(diagonal.dtype))

    def tensors(self) -> List[Tensor]:
        return [self.diagonal]

    def symmetric(self) -> List[bool]:
        return [False]

    def dense(self) -> Tensor:
        return torch.diag(self.diagonal)

    def decompose(self, damping: float, scale: float = 1.0, backend: Optional[str] = None,
                  dtype: Optional[torch.dtype] = None) -> None:
        diag = self.diagonal.to(dtype) if dtype is not None else self.diagonal
        denom = scale * diag + damping
        check_positive(denom, f"diag block {self.layout.name!r}")
        self.decomposition = {"denom": denom}

    def solve(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        d = self._require_decomposition()
        v = self.layout.flatten(vecs).to(d["denom"].dtype)
        return [t.to(x.dtype) for t, x in zip(self.layout.unflatten(v / d["denom"]), vecs)]

    def sample(self, generator: Optional[torch.Generator] = None) -> List[Tensor]:
        d = self._require_decomposition()
        denom = d["denom"]
        z = torch.randn(denom.shape, generator=generator, dtype=denom.dtype, device=denom.device)
        return self.layout.unflatten(z / denom.sqrt())

    def mvp(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        v = self.layout.flatten(vecs).to(self.diagonal.dtype)
        return [t.to(x.dtype) for t, x in zip(self.layout.unflatten(self.diagonal * v), vecs)]
