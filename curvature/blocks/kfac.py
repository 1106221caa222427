"""K-FAC block: ``C ≈ L ⊗ R`` over the row-major ``vec`` of the module's parameter matrix.

For Linear/Conv1d/Conv2d ``L = G`` (output side, ``[d_out, d_out]``) and ``R = A`` (input side, with
a trailing bias entry when the bias is covered); for Embedding ``L = A`` (a diagonal factor
stored as ``[V]``) and ``R = G``. ``.A`` and ``.G`` name the factors whatever their side.

Decompositions of ``scale·L⊗R + damping·I``:

* ``method="eigen"`` (exact damping): with ``L = Q_L Λ_L Q_Lᵀ``, ``R = Q_R Λ_R Q_Rᵀ``,
  ``(scale·L⊗R + λI)⁻¹ vec(V) = vec(Q_L [(Q_Lᵀ V Q_R) ⊘ (scale·λ_L λ_Rᵀ + λ)] Q_Rᵀ)``.
* ``method="inverse"`` (factored Tikhonov, kfac_pytorch's INVERSE): ``(L + λI)⁻¹ V (R + λI)⁻¹``;
  an approximation of the damped inverse, used by the KAISA-compatible preconditioner.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..linalg import get_backend
from ..modules.base import pack_columns
from ..linalg.checks import coarsest_eps
from .base import Block, check_damping, DerivedCache, check_positive, compute_dtype, like_dtype, roundoff_damping
from .layout import Layout


#: eigen-basis solves zero-pad factor sizes ``>= PAD_MIN`` to a multiple of ``PAD_MULTIPLE``: on
#: CPU BLAS ``[512, 785] @ [785, 785]`` runs 4% and ``[512, 512]ᵀ @ [512, 785]`` 15% slower than the
#: padded ``792`` versions; the zero rows/columns add exact zeros, so the result is the same
PAD_MIN = 256
PAD_MULTIPLE = 8


def _dense_factor(f: Tensor) -> Tensor:
    return torch.diag(f) if f.dim() == 1 else f


def _padded_size(k: int) -> int:
    return k if k < PAD_MIN or k % PAD_MULTIPLE == 0 else k + PAD_MULTIPLE - k % PAD_MULTIPLE


def _pad_square(q: Optional[Tensor], size: int) -> Optional[Tensor]:
    if q is None or q.shape[0] == size:
        return q
    out = q.new_zeros(size, size)
    out[:q.shape[0], :q.shape[1]] = q
    return out


class KFACBlock(Block):
    """Kronecker-factored block; factors are ``[n, n]`` matrices or ``[n]`` diagonals."""

    approx = "kfac"

    def __init__(self, layout: Layout, left: Tensor, right: Tensor) -> None:
        super().__init__(layout)
        self.left = left.to(compute_dtype(left.dtype))
        self.right = right.to(compute_dtype(right.dtype))
        self._plan_cache = DerivedCache()  # :meth:`_solve_plan` of the current decomposition
        self._bases_cache = DerivedCache()  # its part that depends on the eigenbases alone (:meth:`_basis_plan`)
        self._eig_cache = DerivedCache()  # the factors' eigendecompositions (:meth:`_factor_eigs`)
        self._eig_key: Tuple[Optional[str], Optional[torch.dtype]] = (None, None)
        #: a fresh block's count of the rows ``A`` is a mean over (the engine sets it: the module's positions
        #: ``N·T``, a routed module seeing part of the batch): the weight of ``A`` where blocks of several
        #: micro-batches or ranks are averaged (torchsso2/optim/routing.py; a number, or a 0-dim tensor: an
        #: Embedding's non-padding positions); None: not known (a tied layout)
        self.rows: Optional[Union[float, Tensor]] = None

    # ---- names --------------------------------------------------------------------------
    @property
    def A(self) -> Tensor:  # noqa: N802 (the field's conventional name)
        """Input-side factor: ``[m, m]`` (``m`` = inputs, +1 with a bias), or ``[m]`` when diagonal (Embedding)."""
        return self.left if self.layout.family.kfac_names()[0] == "A" else self.right

    @property
    def G(self) -> Tensor:  # noqa: N802
        """Output-gradient-side factor: ``[n, n]`` (``n`` = outputs)."""
        return self.left if self.layout.family.kfac_names()[0] == "G" else self.right

    # ---- statistics -----------------------------------------------------------------------
    def tensors(self) -> List[Tensor]:
        return [self.left, self.right]

    def symmetric(self) -> List[bool]:
        return [self.left.dim() == 2, self.right.dim() == 2]

    def dense(self) -> Tensor:
        k = torch.kron(_dense_factor(self.left), _dense_factor(self.right))
        perm = self.layout.matrix_perm().to(k.device)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return k[inv][:, inv]

    def param_diagonal(self) -> List[Tensor]:
        """``diag(L ⊗ R)`` is ``vec(diag(L) diag(R)ᵀ)`` over the parameter matrix: ``[rows, cols]``
        entries (the bias column included where the layout has one), cut back into the parameters."""
        dl = self.left if self.left.dim() == 1 else self.left.diagonal()
        dr = self.right if self.right.dim() == 1 else self.right.diagonal()
        m = torch.outer(dl, dr.to(dl.dtype))
        parts = self.layout.family.from_matrix(self.layout.module, m, self.layout.param_names)
        return [p.contiguous() for p in parts]

    # ---- matrices <-> parameter lists ---------------------------------------------------------
    def _to_matrix(self, vecs: Sequence[Tensor], dtype: torch.dtype,
                   spans: Optional[Sequence[Tuple[int, int]]] = None) -> Tensor:
        """The parameter matrix ``M`` of ``vecs``; with ``spans`` (the family's column split,
        cached in the solve plan) packed directly, as the family's ``to_matrix`` would."""
        if spans is None:
            m = self.layout.family.to_matrix(self.layout.module, list(vecs), self.layout.param_names)
        else:
            m = pack_columns(vecs, spans, vecs[0].shape[0])
        return m if m.dtype == dtype else m.to(dtype)

    def _from_matrix(self, m: Tensor, like: Sequence[Tensor]) -> List[Tensor]:
        parts = self.layout.family.from_matrix(self.layout.module, m, self.layout.param_names)
        return [like_dtype(p, x).contiguous() for p, x in zip(parts, like)]

    # ---- decomposition -------------------------------------------------------------------------
    def decompose(self, damping: float, scale: float = 1.0, backend: Optional[str] = None,
                  dtype: Optional[torch.dtype] = None, method: str = "eigen") -> None:
        check_damping(damping)
        if method == "eigen":
            (el, ql), (er, qr) = self._factor_eigs(backend, dtype)
            denom = torch.outer(el, er.to(el.dtype))  # scale·λ_L λ_Rᵀ + damping, in place (same rounding)
            if scale != 1.0:
                denom.mul_(scale)
            # a damping below the round-off of the largest product is that round-off (roundoff_damping; the
            # Levenberg-Marquardt rule's redamp recovers it from denom: torchsso2/optim/redamp.py)
            largest = scale * el.max() * er.max().to(el.dtype) if denom.numel() else 0.0
            denom.add_(roundoff_damping(damping, largest, coarsest_eps(denom.dtype, self.left.dtype, self.right.dtype)))
            if damping == 0:  # a product is zero within rounding where either factor's eigenvalue is: each factor
                # against its own rounding (n·eps·its largest), not the product's (cond(L)·cond(R) would refuse
                # well-conditioned factors); a diagonal factor is exact
                for e, q, f in ((el, ql, self.left), (er, qr, self.right)):
                    check_positive(e, f"K-FAC block {self.layout.name!r}", size=e.numel() if q is not None else 0,
                                   stored=f.dtype)
            check_positive(denom, f"K-FAC block {self.layout.name!r}")
            self.decomposition = {"method": "eigen", "ql": ql, "qr": qr, "denom": denom}
        elif method == "inverse":
            lb = get_backend(backend)
            inv = []
            for raw in (self.left, self.right):
                stored = raw.dtype
                f = raw.to(dtype) if dtype is not None else raw
                if f.dim() == 1:
                    d = scale * f + damping
                    check_positive(d, f"K-FAC factor of {self.layout.name!r}")
                    inv.append(1.0 / d)
                else:
                    if damping == 0:  # a Cholesky of a singular factor can succeed on round-off: look at its spectrum
                        check_positive(torch.linalg.eigvalsh(scale * f.double()).to(f.dtype),  # f's rounding
                                       f"K-FAC factor of {self.layout.name!r}", size=f.shape[0], stored=stored)
                    # the factor in its stored dtype: damped_inv casts it and keeps the stored dtype's round-off
                    # (a float32 factor cast first would have its float32 rounding judged by float64's eps); a scale
                    # s > 1 is folded into the damping, (s·F + λI)⁻¹ = (F + λ/s·I)⁻¹/s: s·F may not fit the stored
                    # dtype (for s < 1, λ/s may not)
                    if scale > 1.0:
                        inv.append(lb.damped_inv(raw, damping / scale, dtype=dtype).div_(scale))
                    else:
                        inv.append(lb.damped_inv(raw if scale == 1.0 else scale * raw, damping, dtype=dtype))
                scale = 1.0  # the scale multiplies the Kronecker product once
            self.decomposition = {"method": "inverse", "linv": inv[0], "rinv": inv[1]}
        else:
            raise ValueError(f"method={method!r} is not supported; expected 'eigen' or 'inverse'")

    def _factor_eigs(self, backend: Optional[str], dtype: Optional[torch.dtype]
                     ) -> Tuple[Tuple[Tensor, Optional[Tensor]], Tuple[Tensor, Optional[Tensor]]]:
        """``((λ_L, Q_L), (λ_R, Q_R))`` of the factors, kept while the factors are unchanged: a
        decomposition with a new damping or scale only (the Levenberg–Marquardt rule, a checkpoint
        load, a step that decomposes without a new curvature estimate) recomputes ``denom``
        alone instead of two ``eigh`` (digits MLP: ~1.4 ms → ~0.02 ms). Recomputed when a factor
        is replaced or written in place (``_version``), or the backend or dtype changes."""
        key = (backend, dtype)
        if key != self._eig_key:
            self._eig_cache, self._eig_key = DerivedCache(), key

        def eigs() -> Tuple[Tuple[Tensor, Optional[Tensor]], Tuple[Tensor, Optional[Tensor]]]:
            lb = get_backend(backend)
            lay = self.layout
            classes = lay.family.kfac_input_classes(lay.module, lay.param_names) if not lay.tied else None
            a_left = lay.family.kfac_names()[0] == "A"
            return (self._eig_by_class(self.left, classes if a_left else None, lb, dtype),
                    self._eig_by_class(self.right, None if a_left else classes, lb, dtype))
        return self._eig_cache.get([self.left, self.right], eigs)

    @classmethod
    def _eig_by_class(cls, f: Tensor, classes: Optional[Tensor], backend: Any, dtype: Optional[torch.dtype]
                      ) -> Tuple[Tensor, Optional[Tensor]]:
        """:meth:`_eig` of a factor ``f [n, n]`` that is zero between its rows' ``classes`` (``[n]`` int64 labels,
        the family's ``kfac_input_classes``: a strided transposed convolution's input factor) as one ``eigh`` per
        class, the eigenvectors placed in their rows of ``Q``: ``(λ [n], Q [n, n])``, the eigenvalues grouped by
        class rather than ascending (their users take min/max only). A stride-2 4×4 kernel: four ``eigh`` of a
        quarter of the size, 1/16 of the FLOPs. Checked on the factor itself: where it is not zero between the
        classes (K-FAC-reduce's means over positions mix them), one dense ``eigh``."""
        if classes is None or f.dim() != 2 or classes.numel() != f.shape[0]:
            return cls._eig(f, backend, dtype)
        labels = classes.to(f.device)
        blocks = []
        for label in torch.unique(labels):  # each class's columns: its rows hold all of them (peak n·n_c)
            rows = (labels == label).nonzero().squeeze(1)
            columns = f.index_select(1, rows)
            if columns.index_select(0, (labels != label).nonzero().squeeze(1)).any():
                return cls._eig(f, backend, dtype)
            blocks.append((rows, columns.index_select(0, rows)))
        evals, parts = [], []
        for rows, block in blocks:
            e, q = cls._eig(block, backend, dtype)
            evals.append(e)
            parts.append((rows, q))
        q_all = parts[0][1].new_zeros(f.shape)
        start = 0
        for rows, q in parts:
            q_all[rows, start:start + q.shape[1]] = q
            start += q.shape[1]
        return torch.cat(evals), q_all

    @staticmethod
    def _eig(f: Tensor, backend: Any, dtype: Optional[torch.dtype]) -> Tuple[Tensor, Optional[Tensor]]:
        """``(λ clamped to >= 0, Q)`` of a dense factor, ``(f, None)`` of a diagonal one (``backend``:
        a name, None or a resolved :class:`~curvature.linalg.Backend`). A dense
        factor is a Gram matrix or an average of them, symmetric by construction: its lower
        triangle is decomposed (``symmetric=True``, no ``(f + fᵀ)/2`` pass; still checked finite)."""
        if f.dim() == 1:
            return (f.to(dtype) if dtype is not None else f), None
        evals, evecs = get_backend(backend).eigh(f, dtype=dtype, symmetric=True)
        return evals.clamp_min_(0.0), evecs  # evals is the backend's fresh result

    # ---- use -------------------------------------------------------------------------------------
    @staticmethod
    def _rotate_in(ql: Optional[Tensor], m: Tensor, qr: Optional[Tensor]) -> Tensor:
        """``Q_Lᵀ m Q_R`` (a side without eigenbasis, i.e. a diagonal factor, is the identity)."""
        if ql is not None:
            m = torch.mm(ql.t(), m)
        return m if qr is None else torch.mm(m, qr)

    @staticmethod
    def _rotate_out(ql: Optional[Tensor], m: Tensor, qr: Optional[Tensor]) -> Tensor:
        """``Q_L m Q_Rᵀ``."""
        if ql is not None:
            m = torch.mm(ql, m)
        return m if qr is None else torch.mm(m, qr.t())

    @staticmethod
    def _mul_factor_left(f: Tensor, m: Tensor) -> Tensor:
        return f.unsqueeze(1) * m if f.dim() == 1 else f @ m

    @staticmethod
    def _mul_factor_right(m: Tensor, f: Tensor) -> Tensor:
        return m * f.unsqueeze(0) if f.dim() == 1 else m @ f

    def solve(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        d = self._require_decomposition()
        p = self._solve_plan(d)
        if p["direct"] is not None:
            return self._solve_direct(vecs, p["direct"])
        if d["method"] != "eigen":
            m = self._to_matrix(vecs, d["linv"].dtype)
            return self._from_matrix(self._mul_factor_right(self._mul_factor_left(d["linv"], m), d["rinv"]), vecs)
        rows, cols = d["denom"].shape
        if p["ql"] is None and p["qr"] is not None and len(vecs) == 1 and vecs[0].numel() == rows * cols:
            sparse = self._solve_rows(vecs[0], p, rows, cols)
            if sparse is not None:
                return [sparse]
        if p["buffer"] is None:
            m = self._to_matrix(vecs, p["denom"].dtype, p["spans"])
        else:  # straight into the block's zero-padded buffer (kept: no fresh pages every step)
            m = p["buffer"]
            self.layout.family.to_matrix_into(self.layout.module, list(vecs), self.layout.param_names,
                                              m[:rows, :cols])
        rot = self._rotate_in(p["ql"], m, p["qr"])
        if p["qr_parts"] is None:
            return self._from_matrix(self._from_eigenbasis(rot, p)[:rows, :cols], vecs)
        # each parameter straight from its own last matmul, (Q_L (rot ⊘ denom)) Q_R[cols]ᵀ: no copies
        # out of a [rows, cols] result (digits MLP: 116 -> 82 µs a solve; docs/architecture.md)
        left = rot.div_(p["denom"])
        if p["ql"] is not None:
            left = torch.mm(p["ql"], left)[:rows]
        return [like_dtype(torch.mm(left, q).view_as(x), x) for q, x in zip(p["qr_parts"], vecs)]

    @staticmethod
    def _solve_rows(v: Tensor, p: Dict[str, Any], rows: int, cols: int) -> Optional[Tensor]:
        """The solve of a diagonal left factor (an Embedding's token counts) on the rows of ``v`` (``[rows,
        cols]`` row-major) that are not zero, when they are at most half of them (the tokens a batch saw
        in a wide table): the rows are independent, ``x_v = ((v_v Q_R) ⊘ denom_v) Q_Rᵀ``, and a zero row
        solves to zero. Embedding(50000, 64) at 64×16 tokens: two [50000, 64] GEMMs and elementwise
        passes over the table (~11 ms) become the same on ≤ 1024 rows. None: solve densely."""
        m = v.reshape(rows, cols)
        live = m.any(1).nonzero().squeeze(1)  # NaN/inf rows count as live: they stay non-finite
        if 2 * live.numel() > rows:
            return None
        qr, denom = p["qr"], p["denom"]
        sub = m.index_select(0, live).to(denom.dtype)
        if qr.shape[0] != cols:  # the padded basis (zero rows/columns beyond cols)
            sub = torch.nn.functional.pad(sub, (0, qr.shape[0] - cols))
        solved = torch.mm(torch.mm(sub, qr).div_(denom.index_select(0, live)), qr.t())[:, :cols]
        out = torch.zeros_like(m)
        out.index_copy_(0, live, solved.to(out.dtype))
        return out.view_as(v)

    @staticmethod
    def _solve_direct(vecs: Sequence[Tensor], direct: Tuple[Any, ...]) -> List[Tensor]:
        """The solve of two dense, unpadded factors and a column split ``[W | b]``, in as few ops
        as it takes (the common Linear/Conv2d case, run at every step): pack by one ``cat``; eigen:
        ``Q_L ((Q_Lᵀ M Q_R) ⊘ denom)`` with row-major copies of the bases (``eigh`` returns
        column-major ones: ``[64, 65] @ [65, 65]`` 12 → 9 µs); inverse: ``L⁻¹ M``; then each
        parameter from its own last product with the right side (``mv`` for a one-column bias).
        Digits MLP eigen solves: 50/25 → ~45/20 µs."""
        left_op, rows, dt, order, columns = direct
        if len(order) == 1:
            v = vecs[0]
            m = (v if v.dtype == dt else v.to(dt)).reshape(rows, -1)
        else:
            m = torch.cat([(vecs[i] if vecs[i].dtype == dt else vecs[i].to(dt)).reshape(rows, w) for i, w in order], 1)
        left = left_op(m)
        out = []
        for q, x in zip(columns, vecs):
            r = torch.mv(left, q) if q.dim() == 1 else torch.mm(left, q)
            out.append(r.view_as(x) if r.dtype == x.dtype else r.view_as(x).to(x.dtype))
        return out

    def _solve_plan(self, d: Dict[str, Any]) -> Dict[str, Any]:
        """What :meth:`solve` needs of a decomposition ``d``, cached per decomposition (rebuilt
        when any of its tensors is replaced or written in place):

        * ``direct``: for :meth:`_solve_direct` (two dense factors, a column split, no padding):
          the left operation, the rows, the compute dtype, the parameters in column order with
          their widths, and the right side's columns per parameter (a one-column span as a vector);
          None otherwise. For an eigen decomposition also:
        * ``ql``, ``qr``, ``denom``: zero-padded (``denom`` one-padded) to BLAS-friendly sizes
          (:data:`PAD_MIN`, :data:`PAD_MULTIPLE`), with a ``buffer`` for the padded input; or
          ``d``'s own tensors and ``buffer=None`` when no size changes;
        * ``spans``: the family's column split of the parameter matrix (or None), and
          ``qr_parts``: the matching row slices of ``Q_R``, transposed (views), when there is
          such a split and ``Q_R``."""
        if d["method"] != "eigen":
            linv, rinv = d["linv"], d["rinv"]

            def build_inverse() -> Dict[str, Any]:
                spans = self.layout.family.matrix_columns(self.layout.module, self.layout.param_names)
                if spans is None or linv.dim() != 2 or rinv.dim() != 2:
                    return {"direct": None}
                cols = rinv.t().contiguous()  # row j = column j of R⁻¹
                return {"direct": (lambda m: torch.mm(linv, m), linv.shape[0], linv.dtype,
                                   self._column_order(spans), self._right_columns(cols, spans))}
            return self._plan_cache.get([linv, rinv], build_inverse)
        ql, qr, denom = d["ql"], d["qr"], d["denom"]

        def build() -> Dict[str, Any]:
            bases = self._basis_plan(ql, qr, tuple(denom.shape))
            plan: Dict[str, Any] = {"ql": ql, "qr": qr, "denom": denom, "buffer": None}
            rows, cols = bases["padded"]
            if (rows, cols) != tuple(denom.shape):
                dp = denom.new_ones(rows, cols)
                dp[:denom.shape[0], :denom.shape[1]] = denom
                plan = {"ql": bases["ql"], "qr": bases["qr"], "denom": dp, "buffer": denom.new_zeros(rows, cols)}
            plan["spans"], plan["qr_parts"] = bases["spans"], bases["qr_parts"]
            plan["direct"] = None
            if plan["buffer"] is None and plan["qr_parts"] is not None and ql is not None:
                qlt, qlc, qrc = bases["row_major"]
                plan["direct"] = (lambda m: torch.mm(qlc, torch.mm(torch.mm(qlt, m), qrc).div_(denom)),
                                  denom.shape[0], denom.dtype, bases["order"], bases["right_columns"])
            return plan
        return self._plan_cache.get([ql, qr, denom], build)

    def _basis_plan(self, ql: Optional[Tensor], qr: Optional[Tensor], shape: Tuple[int, int]) -> Dict[str, Any]:
        """The part of :meth:`_solve_plan` that depends on the eigenbases alone, cached on them: a new
        ``denom`` with the same bases (a damping change, torchsso2/optim/redamp.py) rebuilds only the
        rest (digits MLP: ~30 µs a block, mostly the row-major copies of the bases, saved). ``shape``:
        ``denom``'s, ``[rows, cols]``."""
        rows = _padded_size(shape[0]) if ql is not None else shape[0]
        cols = _padded_size(shape[1]) if qr is not None else shape[1]

        def build() -> Dict[str, Any]:
            padded = (rows, cols) != shape
            pql, pqr = (_pad_square(ql, rows), _pad_square(qr, cols)) if padded else (ql, qr)
            spans = self.layout.family.matrix_columns(self.layout.module, self.layout.param_names)
            out: Dict[str, Any] = {"padded": (rows, cols), "ql": pql, "qr": pqr, "spans": spans,
                                   "qr_parts": None if spans is None or pqr is None else
                                   [pqr[start:stop].t() for start, stop in spans]}
            if not padded and out["qr_parts"] is not None and ql is not None:
                qlt, qlc, qrc = ql.t().contiguous(), ql.contiguous(), qr.contiguous()  # row-major bases
                out.update(row_major=(qlt, qlc, qrc), order=self._column_order(spans),
                           right_columns=self._right_columns(qrc, spans))
            return out
        bases = self._bases_cache.get([ql, qr], build)
        if bases["padded"] != (rows, cols):  # the padding rule changed (PAD_MIN / PAD_MULTIPLE): build again
            self._bases_cache = DerivedCache()
            bases = self._bases_cache.get([ql, qr], build)
        return bases

    @staticmethod
    def _column_order(spans: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
        """``(parameter index, width)`` in the column order of the parameter matrix."""
        return sorted(((i, stop - start) for i, (start, stop) in enumerate(spans)), key=lambda iw: spans[iw[0]][0])

    @staticmethod
    def _right_columns(rows_of: Tensor, spans: Sequence[Tuple[int, int]]) -> List[Tensor]:
        """Per parameter, the right factor's part its columns come from: rows ``start:stop`` of
        ``rows_of``, transposed (a ``[k, w]`` view), or row ``start`` (a vector) for one column."""
        return [rows_of[start] if stop - start == 1 else rows_of[start:stop].t() for start, stop in spans]

    def solve_low_rank(self, g: Tensor, a: Tensor, like: Sequence[Tensor]) -> List[Tensor]:
        """:meth:`solve` of a gradient given as ``gᵀa`` (``g [R, n_L]``, ``a [R, n_R]``): the
        rotation into the eigenbasis is ``(g Q_L)ᵀ (a Q_R)`` (cheaper when ``R`` is small).
        Needs ``method="eigen"`` and two dense factors; ``like`` gives the output dtypes."""
        d = self._require_decomposition()
        if d["method"] != "eigen" or d["ql"] is None or d["qr"] is None:
            raise ValueError("solve_low_rank needs an eigen decomposition with two dense factors")
        ql, qr = d["ql"], d["qr"]
        rot = (g.to(ql.dtype) @ ql).t() @ (a.to(qr.dtype) @ qr)
        return self._from_matrix(self._from_eigenbasis(rot, d), like)

    def _from_eigenbasis(self, rot: Tensor, d: Dict[str, Any]) -> Tensor:
        """``Q_L (rot ⊘ denom) Q_Rᵀ``: the second half of the eigen-basis solve."""
        # rot is a fresh matmul result when some side rotates (then divide in place, no new pages)
        rot = rot.div_(d["denom"]) if d["ql"] is not None or d["qr"] is not None else rot / d["denom"]
        return self._rotate_out(d["ql"], rot, d["qr"])

    def colour(self, z: Tensor) -> List[Tensor]:
        d = self._require_decomposition()
        if d["method"] != "eigen":
            raise NotImplementedError("sampling needs method='eigen' (the inverse method is not an exact precision)")
        denom = d["denom"]
        z = z.to(denom).view(denom.shape)  # [P] row-major as the [rows, cols] matrix of the layout
        # symmetric square root (basis-independent draws): Q_L [(Q_Lᵀ Z Q_R) ⊘ √denom] Q_Rᵀ. The one-sided
        # Q_L (Z ⊘ √denom) Q_Rᵀ has the same distribution and two matmuls fewer, but its draws depend on
        # the eigenbasis, which is arbitrary inside a repeated eigenvalue (every rank-deficient factor);
        # two backends then draw different samples from one seed (tests/test_linalg_faces.py caught it)
        rot = self._rotate_in(d["ql"], z, d["qr"])
        m = self._rotate_out(d["ql"], rot / denom.sqrt(), d["qr"])
        like = [torch.empty(s, dtype=denom.dtype) for s in self.layout.shapes]
        return self._from_matrix(m, like)

    def mvp(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        m = self._to_matrix(vecs, self.left.dtype)
        return self._from_matrix(self._mul_factor_right(self._mul_factor_left(self.left, m), self.right), vecs)
