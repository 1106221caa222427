"""The uniform interface of a curvature block (one module's block in one shape).

A block holds the *statistics* of the curvature ``C`` (EMA'd over steps), and after
:meth:`Block.decompose` a damped decomposition of ``scale·C + damping·I``:

* :meth:`solve` — ``(scale·C + damping·I)⁻¹ v`` (precondition a gradient),
* :meth:`sample` — a draw from ``N(0, (scale·C + damping·I)⁻¹)``,
* :meth:`mvp` — ``C v``,
* :meth:`dense` — ``C`` as a ``[P, P]`` matrix in flat parameter order.

Vectors are passed as lists of parameter-shaped tensors (the covered parameters of the
module, in ``named_parameters`` order).
"""
from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..linalg.checks import all_finite, owned_all_finite  # noqa: F401  (re-exported: blocks and optimizers use them)
from .layout import Layout


def like_dtype(t: Tensor, x: Tensor) -> Tensor:
    """``t`` in ``x``'s dtype (``t`` itself when they match: no ``.to`` call on hot paths)."""
    return t if t.dtype == x.dtype else t.to(x.dtype)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and decompositions run in float32 or wider, whatever the model dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_damping(damping: Any) -> None:
    """A damping given to a decomposition or a solve: a real number >= 0 and finite (TypeError / ValueError
    naming it); a tensor damping is the caller's (the optimizers' own, checked where it is set)."""
    if isinstance(damping, Tensor):
        return
    if isinstance(damping, bool) or not isinstance(damping, numbers.Real):
        raise TypeError(f"damping must be a real number >= 0, got {type(damping).__name__} {damping!r}")
    if not math.isfinite(float(damping)) or damping < 0:
        raise ValueError(f"damping must be a finite number >= 0, got {damping!r}")


class Block(ABC):
    """One module's curvature in one shape. Subclasses: FullBlock, DiagBlock, KFACBlock.

    Its methods (``mvp``, ``solve``, ``sample``) are the optimizers' hot path and take vectors as they are:
    parameter-shaped tensors in the layout's order (``layout.shapes``), unchecked. :class:`curvature.Curvature`'s
    ``matvec`` / ``solve`` check the vectors (length, order, dtype, device) and are the user-facing ones."""

    approx: str = ""

    if TYPE_CHECKING:  # the shapes' own attributes (KFACBlock.A / .G, DiagBlock.diagonal, ...) on a Block
        # taken from a Dict[str, Block] (curvature.Curvature.blocks): Any to a type checker
        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.decomposition: Optional[Dict[str, Any]] = None

    # ---- statistics ------------------------------------------------------------------
    @abstractmethod
    def tensors(self) -> List[Tensor]:
        """The raw statistics (for EMA, all-reduce, checkpointing)."""

    @abstractmethod
    def symmetric(self) -> List[bool]:
        """For each of :meth:`tensors`: is it a symmetric matrix (upper triangle suffices)."""

    def is_finite(self) -> bool:
        return all_finite(self.tensors())

    @abstractmethod
    def dense(self) -> Tensor:
        """``C`` as ``[P, P]`` in flat parameter order."""

    @abstractmethod
    def param_diagonal(self) -> List[Tensor]:
        """``diag(C)`` as parameter-shaped tensors (the covered parameters, in order), without
        forming ``C`` for the factored shapes."""

    # ---- decomposition and use -----------------------------------------------------------
    @abstractmethod
    def decompose(self, damping: float, scale: float = 1.0, backend: Optional[str] = None,
                  dtype: Optional[torch.dtype] = None) -> None:
        """Decompose ``scale·C + damping·I`` (eigendecomposition) for :meth:`solve`/:meth:`sample`."""

    @abstractmethod
    def solve(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        """``(scale·C + damping·I)⁻¹ v`` for ``v`` given as parameter-shaped tensors."""

    def sample(self, generator: Optional[torch.Generator] = None) -> List[Tensor]:
        """One draw from ``N(0, (scale·C + damping·I)⁻¹)``, parameter-shaped: :meth:`colour` of a
        standard normal ``[P]`` drawn from ``generator`` in the decomposition's dtype and device."""
        ref = next(v for v in self._require_decomposition().values() if isinstance(v, Tensor))
        return self.colour(torch.randn(self.layout.numel, generator=generator, dtype=ref.dtype, device=ref.device))

    @abstractmethod
    def colour(self, z: Tensor) -> List[Tensor]:
        """``S z`` for a standard normal ``z`` of shape ``[P]``, with ``S Sᵀ = (scale·C + damping·I)⁻¹``,
        parameter-shaped: a draw from ``N(0, (scale·C + damping·I)⁻¹)``. ``S`` is a square root of the
        inverse, not necessarily the symmetric one (a K-FAC block reads ``z`` in its Kronecker order:
        equal in distribution). ``z`` is the caller's and may be overwritten (the diagonal block scales
        it in place)."""

    @abstractmethod
    def mvp(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        """``C v`` for ``v`` given as parameter-shaped tensors."""

    def _require_decomposition(self) -> Dict[str, Any]:
        if self.decomposition is None:
            raise RuntimeError(f"block {self.layout.name!r}: call decompose() before solve()/sample()")
        return self.decomposition

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"approx": self.approx, "tensors": [t.clone() for t in self.tensors()],
                "decomposition": None if self.decomposition is None else
                {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in self.decomposition.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("approx") != self.approx:
            raise ValueError(f"block {self.layout.name!r}: checkpoint holds a {state.get('approx')!r} block, "
                             f"expected {self.approx!r}")
        mine = self.tensors()
        theirs = state["tensors"]
        if len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
            raise ValueError(f"block {self.layout.name!r}: checkpoint statistics have shapes "
                             f"{[tuple(b.shape) for b in theirs]}, expected {[tuple(a.shape) for a in mine]}")
        for a, b in zip(mine, theirs):
            a.copy_(b)
        dec = state.get("decomposition")
        self.decomposition = None if dec is None else \
            {k: v.clone() if isinstance(v, Tensor) else v for k, v in dec.items()}  # the caller's stay theirs


class DerivedCache:
    """Tensors derived from some source tensors (a block's decomposition), rebuilt only when a
    source is replaced or written in place (in-place writes bump ``_version``). The sources are
    held, so an identity check cannot be fooled by a reused ``id``."""

    def __init__(self) -> None:
        self._sources: Tuple[Optional[Tensor], ...] = ()
        self._versions: Tuple[Optional[int], ...] = ()
        self._value: Any = None

    def get(self, sources: Sequence[Optional[Tensor]], build: Callable[[], Any]) -> Any:
        if self._value is not None and len(sources) == len(self._sources):
            for new, old, version in zip(sources, self._sources, self._versions):
                if new is not old or (new is not None and new._version != version):
                    break
            else:  # a plain loop: this runs on every solve (2 µs, was 6 with generator expressions)
                return self._value
        self._value = build()
        self._sources = tuple(sources)
        self._versions = tuple(None if t is None else t._version for t in sources)
        return self._value

    def __deepcopy__(self, memo: Dict[int, Any]) -> "DerivedCache":
        """A copy starts empty: ``copy.deepcopy`` gives the copied sources new version counters
        (starting again at 0), so copied ``_versions`` could match a later in-place write of the
        copy and return a value derived from the sources as they were before it."""
        return DerivedCache()

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled empty, for the same reason (unpickled tensors' versions start again at 0)."""
        return {"_sources": (), "_versions": (), "_value": None}


def roundoff_damping(damping: float, largest: Union[Tensor, float], eps: float) -> Union[Tensor, float]:
    """The damping a positive semi-definite block's solve takes: ``damping``, or where that is below the
    round-off ``eps·largest`` of the block's largest eigenvalue ``largest`` (``eps``:
    :func:`~curvature.linalg.checks.coarsest_eps` of the statistics' and the eigenvalues' dtypes), that
    round-off; a 0-dim tensor for a tensor ``largest`` (no host sync). Eigenvalues below it are not resolved
    (float32 factors of inputs ~1e4, or a damping of 1e-10: a first step of norm 170 along directions that
    are round-off); a smaller damping would divide by their noise. Damping 0 stays 0: an undamped solve,
    whose singular blocks :func:`check_positive` refuses."""
    if damping <= 0:
        return damping
    if isinstance(largest, Tensor):  # (a damping beyond the dtype is added as it is: inf, refused by the check)
        return (largest * eps).clamp_min_(damping) if damping < torch.finfo(largest.dtype).max else damping
    return max(damping, eps * largest) if math.isfinite(largest) else damping


def check_positive(evals: Tensor, what: str, size: int = 0, stored: Optional[torch.dtype] = None,
                   additive_damping: bool = False) -> None:
    """Raise LinalgError when a damped spectrum is not strictly positive or not finite.

    ``size``: the order ``n`` of the matrix the eigenvalues come from, given where they carry its
    rounding and nothing lifts them off zero (damping 0): an eigenvalue within ``n·eps·max|λ|`` of
    zero is then a zero eigenvalue of a singular matrix (round-off made it tiny and positive) and
    raises too; a solve would divide by it (a step of 1e18). ``stored``: the dtype the matrix was held in
    when it is coarser than the eigenvalues' (float32 factors decomposed in float64 carry float32's rounding).
    ``additive_damping``: ``evals`` are ``scale·λ(C) + damping`` (a diagonal or full block): the error then carries
    ``damping_shortfall``, how much more damping would lift the smallest of them to the rounding (a
    damping rule's answer to an indefinite Hessian; K-FAC's damping enters through its factors)."""
    from ..linalg import LinalgError

    if not evals.numel():
        return
    if not math.isfinite(float(evals.sum())) and not bool(torch.isfinite(evals).all()):  # exact check only on doubt
        raise LinalgError(f"{what}: non-finite eigenvalues")
    low = float(evals.min())
    eps = max(torch.finfo(evals.dtype).eps, torch.finfo(stored).eps if stored is not None and stored.is_floating_point
              else 0.0)
    rounding = size * eps * float(evals.abs().max()) if size else 0.0
    if low <= rounding:
        error = LinalgError(f"{what}: damped curvature is not positive definite (smallest eigenvalue {low:.3e}"
                            + (f", within the rounding {rounding:.1e} of zero: singular" if low > 0 else "")
                            + "); increase damping")
        if additive_damping:
            error.damping_shortfall = rounding - low
        raise error
