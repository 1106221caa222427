"""Diagonal block: the exact diagonal ``[P]`` of one module's curvature block."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .base import Block, check_damping, DerivedCache, check_positive, compute_dtype
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

    def param_diagonal(self) -> List[Tensor]:
        return self.layout.unflatten(self.diagonal.clone())

    def decompose(self, damping: float, scale: float = 1.0, backend: Optional[str] = None,
                  dtype: Optional[torch.dtype] = None) -> None:
        check_damping(damping)
        diag = self.diagonal.to(dtype) if dtype is not None else self.diagonal
        denom = scale * diag + damping
        check_positive(denom, f"diag block {self.layout.name!r}", additive_damping=True)
        self.decomposition = {"denom": denom}

    def _reciprocals(self) -> Tuple[List[Tensor], Tensor, List[Tensor]]:
        """``1/denom`` as per-parameter views, ``1/√denom`` flat and as per-parameter views, of the
        current decomposition, computed once per decomposition (``solve`` and ``sample`` then cost
        one multiply each; a VI step calls both every step)."""
        denom = self._require_decomposition()["denom"]

        def build() -> Tuple[List[Tensor], Tensor, List[Tensor]]:
            inv = denom.reciprocal()
            inv_sqrt = inv.sqrt()
            return self.layout.unflatten(inv), inv_sqrt, self.layout.unflatten(inv_sqrt)
        return self._reciprocal_cache.get([denom], build)

    def inverse_diagonal(self) -> List[Tensor]:
        """``1/denom`` of the current decomposition as parameter-shaped views (cached, read-only): the
        solve is ``v ⊙ 1/denom``, so a caller can fuse it into its update (``torch._foreach_addcmul_``)."""
        return self._reciprocals()[0]

    def inverse_sqrt_diagonal(self) -> List[Tensor]:
        """``1/√denom`` as parameter-shaped views (cached, read-only): :meth:`colour` is ``z ⊙ 1/√denom``,
        so a caller can fuse it into ``θ + ε`` (``torch._foreach_addcmul``)."""
        return self._reciprocals()[2]

    def solve(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        inv = self._reciprocals()[0]
        vecs = list(vecs)
        if all(x.dtype == d.dtype for x, d in zip(vecs, inv)):  # one foreach multiply (no casts)
            return torch._foreach_mul(vecs, inv)
        return [(x.to(d.dtype) * d).to(x.dtype) for x, d in zip(vecs, inv)]

    def colour(self, z: Tensor) -> List[Tensor]:
        inv_sqrt = self._reciprocals()[1]
        if z.dtype != inv_sqrt.dtype or z.device != inv_sqrt.device:
            z = z.to(inv_sqrt)
        return self.layout.unflatten(z.mul_(inv_sqrt))  # in place: z is the caller's workspace

    def mvp(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        v = self.layout.flatten(vecs).to(self.diagonal.dtype)
        return [t.to(x.dtype) for t, x in zip(self.layout.unflatten(self.diagonal * v), vecs)]
