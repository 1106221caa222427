"""Full block: the exact ``[P, P]`` curvature of one module's covered parameters."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from ..linalg import get_backend
from .base import Block, check_damping, check_positive, compute_dtype
from .layout import Layout


class FullBlock(Block):
    """``C`` stored densely, ``[P, P]``; decomposed by a symmetric eigendecomposition."""

    approx = "full"

    def __init__(self, layout: Layout, matrix: Tensor) -> None:
        super().__init__(layout)
        self.matrix = matrix.to(compute_dtype(matrix.dtype))

    def tensors(self) -> List[Tensor]:
        return [self.matrix]

    def symmetric(self) -> List[bool]:
        return [True]

    def dense(self) -> Tensor:
        return self.matrix.clone()  # (a copy, as the other shapes': not the statistics themselves)

    def param_diagonal(self) -> List[Tensor]:
        return self.layout.unflatten(self.matrix.diagonal().clone())

    def decompose(self, damping: float, scale: float = 1.0, backend: Optional[str] = None,
                  dtype: Optional[torch.dtype] = None) -> None:
        check_damping(damping)
        evals, evecs = get_backend(backend).eigh(self.matrix, dtype=dtype)
        denom = scale * evals + damping
        check_positive(denom, f"full block {self.layout.name!r}", size=self.matrix.shape[0] if damping == 0 else 0,
                       stored=self.matrix.dtype)
        self.decomposition = {"evecs": evecs, "denom": denom}

    def solve(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        d = self._require_decomposition()
        v = self.layout.flatten(vecs).to(d["evecs"].dtype)
        out = d["evecs"] @ ((d["evecs"].t() @ v) / d["denom"])
        return [t.to(x.dtype) for t, x in zip(self.layout.unflatten(out), vecs)]

    def colour(self, z: Tensor) -> List[Tensor]:
        d = self._require_decomposition()
        q = d["evecs"]
        z = z.to(q)
        # the symmetric square root Q D^-1/2 Qᵀ z: the draw depends on the matrix only, not on
        # the (non-unique) eigenvector basis, so every process draws the same sample
        return self.layout.unflatten(q @ ((q.t() @ z) / d["denom"].sqrt()))

    def mvp(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        v = self.layout.flatten(vecs).to(self.matrix.dtype)
        return [t.to(x.dtype) for t, x in zip(self.layout.unflatten(self.matrix @ v), vecs)]
