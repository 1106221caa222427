"""Diagonal block: the exact diagonal ``[P]`` of one module's curvature block."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .base import Block, DerivedCache, check_positive, compute_dtype
from .layout import Layout


class DiagBlock(Block):
    """``diag(C)`` stored as ``[P]``; the damped inverse is elementwise."""

    approx = "diag"

    def __init__(self, layout: Layout, diagonal: Tensor) -> None:
        super().__init__(layout)
        self.diagonal = diagonal.to(compute_dtype(diagonal.dtype))
        self._reciprocal_cache = DerivedCache()  # (1/denom, 1/√denom) of the current decomposition

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

    def _reciprocals(self) -> Tuple[List[Tensor], Tensor]:
        """``1/denom`` as per-parameter views and ``1/√denom`` flat, of the current decomposition,
        computed once per decomposition (``solve`` and ``sample`` then cost one multiply each; a VI
        step calls both every step)."""
        denom = self._require_decomposition()["denom"]

        def build() -> Tuple[List[Tensor], Tensor]:
            inv = denom.reciprocal()
            return self.layout.unflatten(inv), inv.sqrt()
        return self._reciprocal_cache.get([denom], build)

    def solve(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        inv, _ = self._reciprocals()
        vecs = list(vecs)
        if all(x.dtype == d.dtype for x, d in zip(vecs, inv)):  # one foreach multiply (no casts)
            return torch._foreach_mul(vecs, inv)
        return [(x.to(d.dtype) * d).to(x.dtype) for x, d in zip(vecs, inv)]

    def sample(self, generator: Optional[torch.Generator] = None) -> List[Tensor]:
        _, inv_sqrt = self._reciprocals()
        z = torch.randn(inv_sqrt.shape, generator=generator, dtype=inv_sqrt.dtype, device=inv_sqrt.device)
        return self.layout.unflatten(z.mul_(inv_sqrt))

    def mvp(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        v = self.layout.flatten(vecs).to(self.diagonal.dtype)
        return [t.to(x.dtype) for t, x in zip(self.layout.unflatten(self.diagonal * v), vecs)]
