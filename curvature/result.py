"""The result of :func:`curvature.compute`: blocks, and the curvature as a linear operator.

``C`` below is the block-diagonal matrix over the covered parameters (``P`` of them, in
:attr:`Curvature.params` order). Every method except :meth:`Curvature.dense` works block by block
and never forms ``C``: the K-FAC blocks stay factored.

Vectors are either one flat tensor ``[P]`` (or a matrix ``[P, k]`` of ``k`` columns) or a list
of parameter-shaped tensors aligned with :attr:`Curvature.params`; results come back in the
form given.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple, Union, overload

import torch
from torch import Tensor, nn

from .blocks import Block, Layout
from .blocks.base import check_damping
from .running import decompose_block

Vector = Union[Tensor, Sequence[Tensor]]

#: :meth:`Curvature.dense` refuses matrices with more entries than this (2**28 entries: 1 GiB in
#: float32) unless ``max_elements`` says otherwise
DENSE_MAX_ELEMENTS = 2 ** 28


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
    _damping: Any = field(default=None, init=False, repr=False)  # damping of the blocks' decompositions
    _made: Dict[str, Any] = field(default_factory=dict, init=False, repr=False)  # the decompositions solve() made
    #: the statistics those decompositions were made of, with their version counters
    _versions: Dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Curvature":
        """A copy whose :meth:`solve` decomposes again: ``copy.deepcopy`` gives the copied statistics new
        version counters (starting again at 0), so the copied record of what was decomposed could match
        a later in-place write of the copy (:class:`curvature.blocks.base.DerivedCache` likewise)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            setattr(new, key, copy.deepcopy(value, memo))
        new._damping, new._made, new._versions = None, {}, {}
        return new

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled without the record of :meth:`solve`'s decompositions (unpickled versions restart at 0)."""
        return {**self.__dict__, "_damping": None, "_made": {}, "_versions": {}}

    # ---- parameters -------------------------------------------------------------------------
    @property
    def params(self) -> List[nn.Parameter]:
        """Covered parameters, block by block in ``named_modules`` order, each module's in its own
        registration order (the order of :meth:`dense` and of every flat vector); a tied parameter sits
        in the block of the first covered module holding it."""
        return [p for lay in self.layouts.values() for p in lay.params]

    @property
    def param_names(self) -> List[str]:
        """Qualified names (``"fc1.weight"``) of :attr:`params`: the covered module's name and the parameter's
        (``model.named_parameters()`` names a tied parameter after its first holder, which may be skipped)."""
        return [f"{n}.{p}" if n else p for n, lay in self.layouts.items() for p in lay.param_names]

    @property
    def numel(self) -> int:
        """``P``: the number of covered parameter entries (``C`` is ``[P, P]``)."""
        return sum(lay.numel for lay in self.layouts.values())

    @property
    def dtype(self) -> torch.dtype:
        """The blocks' statistics dtype (float32, or float64 for a float64 model)."""
        return next(iter(self.blocks.values())).tensors()[0].dtype if self.blocks else torch.get_default_dtype()

    @property
    def shape(self) -> Tuple[int, int]:
        return (self.numel, self.numel)

    # ---- dense --------------------------------------------------------------------------------
    def dense(self, max_elements: Union[int, None] = DENSE_MAX_ELEMENTS) -> Tensor:
        """``C`` as a ``[P, P]`` block-diagonal matrix over the covered parameters.

        Raises ValueError when ``P²`` exceeds ``max_elements`` (default :data:`DENSE_MAX_ELEMENTS`),
        stating the size; pass ``max_elements=None`` to allocate anyway. :meth:`diagonal`,
        :meth:`matvec`, :meth:`solve` and :meth:`to_scipy` need no dense matrix."""
        p = self.numel
        if max_elements is not None and p * p > max_elements:
            nbytes = p * p * torch.empty((), dtype=self.dtype).element_size()
            raise ValueError(
                f"dense() would allocate a [{p}, {p}] matrix ({p * p:.3e} entries, {nbytes / 2 ** 30:.1f} GiB "
                f"in {self.dtype}), over max_elements={max_elements}; use diagonal(), matvec(), solve() or "
                "to_scipy(), or pass max_elements=None to allocate it anyway")
        return torch.block_diag(*[self.blocks[n].dense() for n in self.layouts])

    # ---- diagonal, products, solves --------------------------------------------------------------
    def diagonal(self) -> List[Tensor]:
        """``diag(C)`` per covered parameter, each in the parameter's shape (aligned with
        :attr:`params`). K-FAC blocks give ``diag(L) diag(R)ᵀ`` over their parameter matrix without
        forming ``L ⊗ R`` (the bias column included where the block covers the bias)."""
        return [d for n in self.layouts for d in self.blocks[n].param_diagonal()]

    @overload
    def matvec(self, v: Tensor) -> Tensor: ...

    @overload
    def matvec(self, v: Sequence[Tensor]) -> List[Tensor]: ...

    def matvec(self, v: Vector) -> Vector:
        """``C v`` for ``v`` flat ``[P]``, ``[P, k]``, or parameter-shaped tensors (see module doc)."""
        return self._blockwise(v, lambda blk, parts: blk.mvp(parts))

    @overload
    def __matmul__(self, v: Tensor) -> Tensor: ...

    @overload
    def __matmul__(self, v: Sequence[Tensor]) -> List[Tensor]: ...

    def __matmul__(self, v: Vector) -> Vector:
        return self.matvec(v)

    @overload
    def solve(self, v: Tensor, damping: Union[float, Tensor]) -> Tensor: ...

    @overload
    def solve(self, v: Sequence[Tensor], damping: Union[float, Tensor]) -> List[Tensor]: ...

    def solve(self, v: Vector, damping: Union[float, Tensor]) -> Vector:
        """``(C + damping·I)⁻¹ v`` over all blocks (exact damping: K-FAC blocks are decomposed in
        their eigenbases, ``(L ⊗ R + λI)⁻¹``). The decompositions are kept for further solves with
        the same ``damping``, a number (a one-element tensor is read as its value, without gradient). Raises
        ``curvature.linalg.LinalgError`` when ``C + damping·I`` is not positive definite (``damping=0`` on a
        singular ``C``; full blocks keep the round-off negative eigenvalues of a singular ``C``, so a damping
        below them fails there, where diag and K-FAC blocks clamp theirs at 0)."""
        if isinstance(damping, Tensor) and damping.numel() == 1 and not damping.is_complex():
            damping = damping.item()  # taken as a number: no gradient flows to a damping that requires one
        if isinstance(damping, Tensor):
            raise TypeError(f"damping must be a real number >= 0 or a one-element real tensor, got a tensor of shape "
                            f"{tuple(damping.shape)} and dtype {damping.dtype}")
        check_damping(damping)
        damping = float(damping)
        narrow = [t.dtype for b in self.blocks.values() for t in b.tensors()[:1]
                  if t.is_floating_point() and t.dtype != torch.float64]
        if narrow and damping > torch.finfo(narrow[0]).max:
            raise ValueError(f"damping={damping!r} is beyond the largest {narrow[0]} "
                             f"({torch.finfo(narrow[0]).max:.2e}), the curvature's dtype; convert it first "
                             "(compute on a float64 model) or pass a smaller damping")
        # the decompositions made here, at this damping, of the statistics as they are (a block decomposed
        # since, e.g. through its own decompose(), or whose statistics changed in place, is decomposed again)
        versions = {n: [(t, t._version) for t in b.tensors()] for n, b in self.blocks.items()}
        if self._damping != damping or not _same_tensors(versions, self._versions) or any(
                b.decomposition is None or b.decomposition is not self._made.get(n) for n, b in self.blocks.items()):
            for blk in self.blocks.values():  # (a Fisher-type kind's full blocks: negative eigenvalues are round-off)
                decompose_block(blk, damping, psd=self.kind != "hessian")
            self._damping = damping
            self._made = {n: b.decomposition for n, b in self.blocks.items()}
            self._versions = versions
        return self._blockwise(v, lambda blk, parts: blk.solve(parts))

    def to_scipy(self) -> Any:
        """``C`` as a ``scipy.sparse.linalg.LinearOperator`` (shape ``(P, P)``, float64, symmetric;
        ``matvec`` takes and returns numpy vectors), for ``eigsh``, ``cg``, ``lsqr``... Needs scipy."""
        from .scipy_operator import to_linear_operator

        return to_linear_operator(self)

    as_linear_operator = to_scipy

    # ---- helpers ---------------------------------------------------------------------------------
    def _blockwise(self, v: Vector, op: Any) -> Vector:
        if not isinstance(v, (Tensor, list, tuple)):
            raise TypeError(f"expected a tensor [{self.numel}] or [{self.numel}, k], or a list of tensors shaped "
                            f"like the parameters, got {type(v).__name__}")
        device = next((b.tensors()[0].device for b in self.blocks.values() if b.tensors()), None)
        for t in ([v] if isinstance(v, Tensor) else v):
            if isinstance(t, Tensor) and (not t.is_floating_point() or t.is_complex()):
                raise TypeError(f"expected real floating-point vectors, got dtype {t.dtype} (integer, bool and "
                                "complex vectors would be cast and lose their values)")
            if isinstance(t, Tensor) and device is not None and t.device != device:
                raise ValueError(f"the vector is on {t.device}, the curvature on {device}: move it there first "
                                 f"(v.to({str(device)!r}))")
        if isinstance(v, Tensor):
            if v.dim() == 2 and v.shape[0] != self.numel:
                raise ValueError(f"expected a flat vector of shape [{self.numel}] (or [{self.numel}, k]), "
                                 f"got {tuple(v.shape)}")
            if v.dim() == 2:
                if v.shape[1] == 0:  # no columns: nothing to map (torch.stack refuses an empty list)
                    return v.new_empty(self.numel, 0)
                return torch.stack([self._blockwise(col, op) for col in v.t()], dim=1)
            if v.shape != (self.numel,):
                raise ValueError(f"expected a flat vector of shape [{self.numel}] (or [{self.numel}, k]), "
                                 f"got {tuple(v.shape)}")
            parts: List[Tensor] = []
            i = 0
            for lay in self.layouts.values():
                parts.extend(lay.unflatten(v[i:i + lay.numel].contiguous()))
                i += lay.numel
            return torch.cat([t.reshape(-1) for t in self._blockwise(parts, op)])
        parts = list(v)
        shapes = [s for lay in self.layouts.values() for s in lay.shapes]
        if len(parts) != len(shapes) or any(not isinstance(t, Tensor) or t.shape != s for t, s in zip(parts, shapes)):
            got = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in parts]
            raise ValueError(f"expected {len(shapes)} tensors shaped {[tuple(s) for s in shapes]} "
                             f"(the covered parameters), got {got}")
        out: List[Tensor] = []
        i = 0
        for n, lay in self.layouts.items():
            k = len(lay.shapes)
            out.extend(op(self.blocks[n], parts[i:i + k]))
            i += k
        return out


def _same_tensors(now: Dict[str, Any], then: Dict[str, Any]) -> bool:
    """Whether every block holds the same statistics tensors, unchanged in place, as ``then``."""
    return now.keys() == then.keys() and all(
        len(now[n]) == len(then[n]) and all(t is u and v == w for (t, v), (u, w) in zip(now[n], then[n]))
        for n in now)
