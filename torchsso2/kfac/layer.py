"""One registered layer's K-FAC state: factor batches, running factors, decompositions.

The parameter matrix is the engine's (:meth:`~curvature.modules.base.LayerFamily.to_matrix`):
``M = [W.reshape(d_out, -1) | b] [d_out, d_in(+1)]`` — kfac_pytorch's ``get_grad()`` layout —
and the K-FAC block is ``G ⊗ A`` over row-major ``vec(M)``.

Decompositions (kfac_pytorch's ``KFACEigenLayer`` / ``KFACInverseLayer``):

* eigen: ``A = Q_A diag(λ_A) Q_Aᵀ``, ``G = Q_G diag(λ_G) Q_Gᵀ`` (``λ`` clamped at 0). With
  ``prediv`` (``compute_eigenvalue_outer_product``) the G worker also stores
  ``D = 1 / (λ_G λ_Aᵀ + damping)`` with the damping of the inverse step; otherwise damping is
  read at preconditioning time.
* inverse: ``(A + damping·I)⁻¹``, ``(G + damping·I)⁻¹``.

Decompositions run in ``float64`` if the factor or ``inv_dtype`` is ``float64``, else in
``float32`` (kfac_pytorch: always ``float32``), and are stored in ``inv_dtype``.
"""
from __future__ import annotations

import math

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from curvature.blocks.layout import held_parameters
from curvature.linalg import Backend, LinalgError
from curvature.modules.base import LayerFamily

from .enums import ComputeMethod
from .factors import kfac_pytorch_factors

logger = logging.getLogger(__name__)

FACTORS: Tuple[str, str] = ("A", "G")


def _nbytes(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class KFACLayer:
    """K-FAC state of one ``nn.Linear`` / ``nn.Conv2d``.

    Args:
        name: the module's name in ``model.named_modules()``.
        module: the layer.
        family: its engine family.
        method: eigen or inverse.
        prediv: precompute ``1 / (λ_G λ_Aᵀ + damping)`` (eigen only).
        factor_dtype: dtype of the factors (``None``: the training dtype).
        inv_dtype: dtype of the stored decompositions.
        backend: linear-algebra backend of the decompositions.
    """

    def __init__(self, name: str, module: nn.Module, family: LayerFamily, method: ComputeMethod,
                 prediv: bool, factor_dtype: Optional[torch.dtype], inv_dtype: torch.dtype,
                 backend: Backend) -> None:
        self.name = name
        self.module = module
        self.family = family
        self.method = method
        self.prediv = prediv and method is ComputeMethod.EIGEN
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.backend = backend
        # weight and bias (kfac_pytorch's get_grad); another parameter of a layer subclass keeps its plain gradient
        self.param_names: Tuple[str, ...] = tuple(n for n, _ in family.covered_params(module) if n in ("weight", "bias"))
        rows, cols = family.weight_matrix_shape(module)  # type: ignore[attr-defined]
        self.sizes: Dict[str, int] = {"A": cols + int("bias" in self.param_names), "G": rows}
        # factor batches of the current step (sums over micro-batches and their counts; A is counted per
        # recorded forward, G per backward through it, as kfac_pytorch's forward and backward hooks do)
        self.a_batch: Optional[Tensor] = None
        self.g_batch: Optional[Tensor] = None
        self.a_count = 0
        self.g_count = 0
        # running averages
        self.a_factor: Optional[Tensor] = None
        self.g_factor: Optional[Tensor] = None
        # the running factors before the first fold since the last step (put back if it is skipped)
        self._before_fold: Optional[Tuple[Optional[Tensor], Optional[Tensor]]] = None
        #: contributions (A: forwards, G: backwards) folded into the running factors since the last step: this
        #: rank's weight in the factors' average over ranks (torchsso2/kfac/kaisa.py)
        self.fold_counts: Dict[str, int] = {"A": 0, "G": 0}
        # decompositions: name -> tensor (qa, da, qg, dg, dgda / a_inv, g_inv)
        self.inv: Dict[str, Tensor] = {}
        #: whether decompositions exist on the layer's grad workers (same on every rank)
        self.inv_ready = False
        #: why a decomposition of the current inverse step failed on this rank (None: none did)
        self.decomposition_error: Optional[str] = None

    def __repr__(self) -> str:
        return f"KFACLayer({self.name!r}, {type(self.module).__name__}, A={self.sizes['A']}, G={self.sizes['G']})"

    # ---- parameters -------------------------------------------------------------------
    @property
    def params(self) -> List[nn.Parameter]:
        return held_parameters(self.name, self.module, self.param_names)

    def has_grad(self) -> bool:
        return all(p.grad is not None for p in self.params)

    def grad_matrix(self) -> Tensor:
        """The gradient as the parameter matrix ``[d_out, d_in(+1)]``."""
        return self.family.to_matrix(self.module, [p.grad for p in self.params], self.param_names)

    def set_grad(self, matrix: Tensor, scale: Optional[float] = None) -> None:
        """Write ``scale · matrix`` into the parameters' ``.grad`` (in place); a parameter frozen since
        (``requires_grad_(False)``) keeps its gradient: written, the Kronecker coupling put a non-zero one on a
        frozen bias whose zero gradient ``zero_grad(set_to_none=False)`` had left, and the optimizer moved it."""
        if scale is not None:
            matrix = matrix * scale
        parts = self.family.from_matrix(self.module, matrix, self.param_names)
        for p, part in zip(self.params, parts):
            if not p.requires_grad:
                continue
            assert p.grad is not None
            p.grad.copy_(part.reshape(p.grad.shape))

    # ---- factors ------------------------------------------------------------------------
    @property
    def batch_count(self) -> int:
        """How many contributions wait in the batch (forwards for ``A``, backwards for ``G``)."""
        return max(self.a_count, self.g_count)

    def accumulate(self, inputs: Tuple[Tensor, ...], grad_output: Tensor,
                   grad_scale: Optional[float] = None, with_a: bool = True) -> bool:
        """Add one forward/backward pair's ``(A, G)`` to the batch (only ``G`` with ``with_a=False``:
        a second backward through a recorded forward, ``retain_graph=True``).

        With a ``grad_scale`` (AMP) a non-finite contribution (an overflowing backward) is
        skipped and False returned; without one no check is made (no device sync).
        """
        a, g = kfac_pytorch_factors(self.family, self.module, inputs, grad_output, self.param_names,
                                    self.factor_dtype, grad_scale)
        if grad_scale is not None and not (bool(torch.isfinite(g).all()) and bool(torch.isfinite(a).all())):
            logger.warning("K-FAC layer %r: non-finite factor contribution skipped (AMP overflow?)", self.name)
            return False
        if with_a:
            self.a_batch = a if self.a_batch is None else self.a_batch + a
            self.a_count += 1
        self.g_batch = g if self.g_batch is None else self.g_batch + g
        self.g_count += 1
        return True

    def update_factors(self, decay: float) -> bool:
        """Fold the batch into the running factors: ``F ← decay·F + (1 − decay)·mean(batch)``, each
        factor that has a batch (only ``G`` after a second backward through a forward already
        folded, as kfac_pytorch).

        A factor starts as the identity (kfac_pytorch). Returns whether there was a batch.
        """
        if self.a_batch is None and self.g_batch is None:
            return False
        if self._before_fold is None:  # the fold makes new tensors: the old ones are kept as they are
            self._before_fold = (self.a_factor, self.g_factor)
        elif not self._folded_finite():  # a non-finite batch folded and never stepped (the user dropped it on
            self.a_factor, self.g_factor = self._before_fold  # its NaN loss): this batch starts from the last step's
            self.fold_counts = {"A": 0, "G": 0}
        if self.a_batch is not None:
            self.fold_counts["A"] += self.a_count
        if self.g_batch is not None:
            self.fold_counts["G"] += self.g_count
        if self.a_batch is not None:
            self.a_factor = self._ema(self.a_factor, self.a_batch / self.a_count if self.a_count > 1
                                      else self.a_batch, decay)
        if self.g_batch is not None:
            self.g_factor = self._ema(self.g_factor, self.g_batch / self.g_count if self.g_count > 1
                                      else self.g_batch, decay)
        self.reset_batch()
        return True

    @staticmethod
    def _ema(old: Optional[Tensor], new: Tensor, decay: float) -> Tensor:
        if old is None:
            old = torch.eye(new.shape[0], dtype=new.dtype, device=new.device)
        return decay * old + (1.0 - decay) * new

    def reset_batch(self) -> None:
        self.a_batch = self.g_batch = None
        self.a_count = self.g_count = 0

    def keep_folds(self) -> None:
        """The step went through: the factors folded since the last step stay."""
        self._before_fold = None
        self.fold_counts = {"A": 0, "G": 0}

    def undo_folds(self) -> None:
        """The step is skipped: the running factors go back to what they were at the last step
        (the same tensors), and the pending batch is dropped."""
        if self._before_fold is not None:
            self.a_factor, self.g_factor = self._before_fold
            self._before_fold = None
        self.fold_counts = {"A": 0, "G": 0}
        self.reset_batch()

    def factor(self, key: str) -> Optional[Tensor]:
        """The running factor ``"A"`` or ``"G"`` (None before the first fold)."""
        return self.a_factor if key == "A" else self.g_factor

    def zero_factor(self, key: str) -> Tensor:
        """Zero ``[n, n]`` for factor ``"A"`` / ``"G"``, in the dtype and on the device a fold here would give it
        (the old factor's promoted with the contributions': ``factor_dtype``, else the parameters' dtype, at
        least float32): this rank's part of the all-reduce of a factor that only other ranks updated."""
        old = self.factor(key)
        p = self.params[0]
        computed = self.factor_dtype or (torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype)
        dtype = computed if old is None else torch.promote_types(old.dtype, computed)
        device = p.device if old is None else old.device
        return torch.zeros(self.sizes[key], self.sizes[key], dtype=dtype, device=device)

    def adopt_factor(self, key: str, value: Tensor) -> None:
        """Take a running factor that other ranks updated in this step (the old factors are kept, as a fold
        keeps them, for a skipped step to put back)."""
        if self._before_fold is None:
            self._before_fold = (self.a_factor, self.g_factor)
        if key == "A":
            self.a_factor = value
        else:
            self.g_factor = value

    def factors(self) -> List[Tensor]:
        assert self.a_factor is not None and self.g_factor is not None
        return [self.a_factor, self.g_factor]

    def has_factors(self) -> bool:
        return self.a_factor is not None and self.g_factor is not None

    # ---- decompositions -------------------------------------------------------------------
    def _compute_dtype(self, factor: Tensor) -> torch.dtype:
        return torch.float64 if torch.float64 in (factor.dtype, self.inv_dtype) else torch.float32

    def compute(self, factor: str, damping: float) -> None:
        """Decompose factor ``"A"`` or ``"G"`` (on its inverse worker)."""
        f = self.a_factor if factor == "A" else self.g_factor
        if f is None:
            raise RuntimeError(f"K-FAC layer {self.name!r}: factor {factor} has not been computed yet")
        key = factor.lower()
        dtype = self._compute_dtype(f)
        try:
            if self.method is ComputeMethod.INVERSE:
                inv = self.backend.damped_inv(f, damping, dtype=dtype)
            else:
                evals, evecs = self.backend.eigh(f, dtype=dtype)
        except LinalgError as exc:
            # NaN results instead of an exception: the other ranks are waiting for them in the
            # broadcast; the step's check of the preconditioned gradients then skips the step
            # (or raises) on every rank alike and puts the previous decompositions back
            if self.decomposition_error is None:  # the first failure of the step
                self.decomposition_error = f"factor {factor}: {exc}"
            logger.warning("K-FAC layer %r: decomposing factor %s failed: %s", self.name, factor, exc)
            n = f.shape[0]
            inv = torch.full((n, n), float("nan"), dtype=dtype, device=f.device)
            evals, evecs = inv[0], inv
        if self.method is ComputeMethod.INVERSE:
            self.inv[f"{key}_inv"] = inv.to(self.inv_dtype).contiguous()
            return
        # contiguous (eigh returns column-major Q): the ranks that receive Q by broadcast hold
        # it row-major, and the same layout everywhere makes every rank's matmuls bit-identical
        self.inv[f"q{key}"] = evecs.to(self.inv_dtype).contiguous()
        self.inv[f"d{key}"] = evals.clamp(min=0.0).to(self.inv_dtype)
        if self.prediv and factor == "G":
            if "da" not in self.inv:
                raise RuntimeError(f"K-FAC layer {self.name!r}: compute_eigenvalue_outer_product needs A "
                                   "decomposed on the same rank first (colocate_factors=True)")
            dg, da = self.inv.pop("dg"), self.inv.pop("da")
            self.inv["dgda"] = 1.0 / (torch.outer(dg, da) + damping)

    @property
    def decomposition_kind(self) -> List[Any]:
        """``[method name, prediv]``: what a checkpoint's decompositions of this layer are (``torchsso2/kfac/state.py``)."""
        return [self.method.name, self.prediv]

    def decomposition_shapes(self, factor: Optional[str] = None) -> Dict[str, Tuple[int, ...]]:
        """``{key: shape}`` of the decomposition tensors of factor ``"A"``, ``"G"`` or (``None``)
        both, as a grad worker of the layer holds them (``n_A = sizes["A"]``, ``n_G = sizes["G"]``):
        inverse ``a_inv [n_A, n_A]``, ``g_inv [n_G, n_G]``; eigen ``qa [n_A, n_A]``, ``da [n_A]``,
        ``qg [n_G, n_G]``, ``dg [n_G]``, or with ``prediv`` ``qa``, ``qg`` and ``dgda [n_G, n_A]``."""
        if factor is None:
            return {**self.decomposition_shapes("A"), **self.decomposition_shapes("G")}
        n_a, n_g = self.sizes["A"], self.sizes["G"]
        if self.method is ComputeMethod.INVERSE:
            return {"a_inv": (n_a, n_a)} if factor == "A" else {"g_inv": (n_g, n_g)}
        if factor == "A":
            return {"qa": (n_a, n_a)} if self.prediv else {"qa": (n_a, n_a), "da": (n_a,)}
        return {"qg": (n_g, n_g), "dgda": (n_g, n_a)} if self.prediv else {"qg": (n_g, n_g), "dg": (n_g,)}

    def inverse_tensors(self, factor: str, receive: bool = False) -> List[Tensor]:
        """What factor ``"A"``/``"G"``'s worker broadcasts; with ``receive`` new empty buffers
        (the previous decompositions are not overwritten in place: a skipped step puts them back)."""
        specs = self.decomposition_shapes(factor)
        device = self.params[0].device
        for key, shape in specs.items():
            t = self.inv.get(key)
            if receive or t is None or tuple(t.shape) != shape:
                self.inv[key] = torch.empty(shape, dtype=self.inv_dtype, device=device)
        return [self.inv[key] for key in specs]

    # ---- preconditioning ----------------------------------------------------------------------
    def precondition(self, grad: Tensor, damping: float) -> Tensor:
        """The preconditioned gradient matrix (``grad``'s dtype) from the decompositions."""
        try:
            if self.method is ComputeMethod.INVERSE:
                a_inv, g_inv = self.inv["a_inv"], self.inv["g_inv"]
                return (g_inv @ grad.to(a_inv.dtype) @ a_inv).to(grad.dtype)
            qa, qg = self.inv["qa"], self.inv["qg"]
            if self.prediv:
                v = qg.t() @ grad.to(qa.dtype) @ qa
                return (qg @ (v * self.inv["dgda"]) @ qa.t()).to(grad.dtype)
            out = self.backend.kron_eigen_solve(self.inv["dg"], qg, self.inv["da"], qa,
                                                grad.to(qa.dtype), damping)
            return out.to(grad.dtype)
        except KeyError as exc:
            raise RuntimeError(f"K-FAC layer {self.name!r}: decomposition {exc} missing on this rank") from None

    # ---- bookkeeping -----------------------------------------------------------------------------
    def memory_usage(self) -> Dict[str, int]:
        """Bytes held by this layer on this rank (kfac_pytorch's keys)."""
        a_keys = ("qa", "da", "a_inv")
        g_keys = ("qg", "dg", "dgda", "g_inv")
        return {
            "a_factors": _nbytes(self.a_factor),
            "g_factors": _nbytes(self.g_factor),
            "a_batch": _nbytes(self.a_batch),
            "g_batch": _nbytes(self.g_batch),
            "a_inverses": sum(_nbytes(self.inv.get(k)) for k in a_keys),
            "g_inverses": sum(_nbytes(self.inv.get(k)) for k in g_keys),
        }

    def _folded_finite(self) -> bool:
        """Whether the factors folded since the last step are finite (True when none were folded)."""
        return self._before_fold is None or all(bool(torch.isfinite(t).all()) for t in (self.a_factor, self.g_factor)
                                                if t is not None)

    def state_dict(self) -> Dict[str, Optional[Tensor]]:
        """``{"A": [a, a], "G": [g, g]}``; a non-finite fold not yet checked by a step (a batch the user
        dropped without calling step) is left out: the factors of the last step."""
        if not self._folded_finite():
            assert self._before_fold is not None
            a, g = self._before_fold
            return {"A": a, "G": g}
        return {"A": self.a_factor, "G": self.g_factor}

    def load_state_dict(self, state: Dict[str, Optional[Tensor]]) -> None:
        if "A" not in state or "G" not in state:
            raise KeyError(f"K-FAC layer {self.name!r}: state must have keys 'A' and 'G', got {sorted(state)}")
        device = self.params[0].device
        for key, expected in (("A", self.sizes["A"]), ("G", self.sizes["G"])):
            t = state[key]
            if t is not None and tuple(t.shape) != (expected, expected):
                raise ValueError(f"K-FAC layer {self.name!r}: factor {key} has shape {tuple(t.shape)}, "
                                 f"expected {(expected, expected)}")
        self.a_factor = None if state["A"] is None else state["A"].to(device).clone()
        self.g_factor = None if state["G"] is None else state["G"].to(device).clone()


def grad_scale_of(grad_scaler: object) -> Optional[float]:
    """The current loss scale of a ``GradScaler`` (``get_scale()``) or a callable, or None.

    Raises:
        ValueError: a callable's scale that is not a finite number > 0 (0 or NaN made every output-side
            factor contribution count as an AMP overflow, so the layers were never preconditioned; inf
            zeroed them)."""
    if grad_scaler is None:
        return None
    get = getattr(grad_scaler, "get_scale", None)
    if callable(get):
        return float(get())
    scale = float(grad_scaler())  # type: ignore[operator]
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"grad_scaler() returned {scale!r}; the loss scale must be a finite number > 0 (the factor "
                         "by which the loss, and so every gradient, was multiplied)")
    return scale

