"""Full block: the exact ``[P, P]`` curvature of one module's covered parameters."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import Tensor

from ..linalg import get_backend
from ..linalg.checks import coarsest_eps
from .base import Block, check_damping, check_positive, compute_dtype, roundoff_damping
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
                  dtype: Optional[torch.dtype] = None, psd: bool = False) -> None:
        """``scale·C + damping·I`` by ``eigh``. ``psd``: ``C`` is positive semi-definite by construction (a
        Fisher-type matrix, an average of Gram matrices), so a negative eigenvalue is round-off and is taken
        as 0, as K-FAC's factors' are (the empirical Fisher of inputs ~1e4 accumulated in float32 had
        eigenvalues down to −11 beside 1e8: every decomposition at damping 0.1 failed), and a damping below
        the round-off of the largest eigenvalue is raised to it (:func:`~curvature.blocks.base.roundoff_damping`);
        the Hessian's may be indefinite and is decomposed as it is."""
        check_damping(damping)
        evals, evecs = get_backend(backend).eigh(self.matrix, dtype=dtype)
        added: Any = damping
        if psd and evals.numel():
            evals = evals.clamp_min(0.0)
            added = roundoff_damping(damping, scale * evals.max(), coarsest_eps(evals.dtype, self.matrix.dtype))
        denom = scale * evals + added
        check_positive(denom, f"full block {self.layout.name!r}", size=self.matrix.shape[0] if damping == 0 else 0,
                       stored=self.matrix.dtype, additive_damping=not psd)
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
