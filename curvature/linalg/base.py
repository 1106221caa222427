"""The backend interface: what every linear-algebra backend provides.

:class:`Backend` holds the public methods (validation, dtype policy, damping and
error wrapping, written once) and declares the few primitives each implementation
supplies. A primitive receives torch tensors that are already validated, finite,
symmetrized where relevant and cast to the compute dtype, and returns torch tensors
on the input's device in that dtype.

Shapes use ``...`` for optional leading batch dimensions; batch dimensions of
different arguments broadcast.
"""
from __future__ import annotations

import abc
import math
from typing import Optional

import torch
from torch import Tensor

from .checks import (
    check_batch,
    check_finite,
    check_nonnegative_scalar,
    check_square,
    coarsest_eps,
    prepare_symmetric,
    resolve_compute_dtype,
)
from .eigh_retry import eigh_with_retry
from .errors import LinalgError

__all__ = ["Backend"]


class Backend(abc.ABC):
    """Symmetric eigendecomposition, Cholesky and SPD inverse/solve on torch tensors.

    Instances are stateless and immutable; obtain one with
    :func:`curvature.linalg.get_backend`. Every method accepts torch tensors on any
    device the backend supports and returns torch tensors on the same device, in the
    compute dtype ``max(float32, input dtype)`` or the explicit ``dtype``.

    Every failure of the math (non-finite input, not positive definite after
    damping, no convergence) raises :class:`~curvature.linalg.LinalgError`; wrong
    shapes, dtypes or devices raise :class:`ValueError`.
    """

    #: Backend name, one of :data:`curvature.linalg.BACKEND_NAMES`.
    name: str

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # ------------------------------------------------------------------ public API
    def eigh(self, a: Tensor, dtype: Optional[torch.dtype] = None, *, symmetric: bool = False
             ) -> tuple[Tensor, Tensor]:
        """Eigendecomposition of the symmetric part of ``a``.

        Args:
            a: ``[..., n, n]`` real matrix; ``(a + aᵀ) / 2`` is decomposed.
            dtype: compute dtype (float32/float64); ``None`` means
                ``max(float32, a.dtype)``. Use float64 for ill-conditioned factors.
            symmetric: ``True`` when ``a`` is symmetric by construction (a Gram matrix, an
                average of them): the ``(a + aᵀ) / 2`` pass is skipped and ``a``'s lower
                triangle is decomposed, which differs from the symmetric part only by the
                rounding of the Gram's two triangles. ``a`` is still checked finite.

        Returns:
            ``(evals, evecs)``: ``evals`` ``[..., n]`` in ascending order and
            ``evecs`` ``[..., n, n]`` with orthonormal columns, so that
            ``evecs @ diag(evals) @ evecsᵀ ≈ (a + aᵀ) / 2``.

        A decomposition that fails or returns NaN/Inf is retried in float64, then in float64
        with a tiny diagonal jitter (:mod:`curvature.linalg.eigh_retry`); only when every
        attempt fails is :class:`~curvature.linalg.LinalgError` raised.
        """
        a = prepare_symmetric(a, dtype, "eigh", self.name, symmetrize=not symmetric)
        return eigh_with_retry(self._eigh, a, self.name)

    def cholesky(self, a: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
        """Lower-triangular Cholesky factor ``L`` ``[..., n, n]`` with ``L Lᵀ = a``.

        Args:
            a: ``[..., n, n]`` symmetric positive-definite matrix (symmetrized first).
            dtype: compute dtype, see :meth:`eigh`.
        """
        a = prepare_symmetric(a, dtype, "cholesky", self.name)
        return self._cholesky(a)

    def inv(self, a: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
        """Inverse ``[..., n, n]`` of the SPD matrix ``a``, computed via Cholesky.

        Args:
            a: ``[..., n, n]`` symmetric positive-definite matrix (symmetrized first).
            dtype: compute dtype, see :meth:`eigh`.

        Returns:
            symmetric ``a⁻¹`` ``[..., n, n]``.
        """
        a = prepare_symmetric(a, dtype, "inv", self.name)
        return self._inv(a)

    def solve(self, a: Tensor, rhs: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
        """``a⁻¹ rhs`` for SPD ``a``, computed via Cholesky.

        Args:
            a: ``[..., n, n]`` symmetric positive-definite matrix (symmetrized first).
            rhs: ``[..., n, k]`` matrix, or a vector ``[n]`` / ``[..., n]`` (a vector
                when it is 1-D or its shape equals ``a.shape[:-1]``, as in
                :func:`torch.linalg.solve`). Batch dims broadcast with ``a``'s.
            dtype: compute dtype; ``None`` means ``max(float32, a.dtype, rhs.dtype)``.

        Returns:
            solution with ``rhs``'s shape (broadcast batch dims), compute dtype.
        """
        n = check_square(a, "solve")
        compute = resolve_compute_dtype([a.dtype, rhs.dtype], dtype, "solve")
        if rhs.device != a.device:
            raise ValueError(
                f"solve: a is on {a.device} but rhs is on {rhs.device}; "
                "put both on the same device"
            )
        is_vector = rhs.ndim == 1 or (rhs.ndim == a.ndim - 1 and rhs.shape == a.shape[:-1])
        rows = rhs.shape[-1] if is_vector else (rhs.shape[-2] if rhs.ndim >= 2 else -1)
        if rows != n:
            raise ValueError(
                f"solve: rhs must be [..., n, k] or [..., n] with n = {n} "
                f"(a has shape {tuple(a.shape)}), got rhs of shape {tuple(rhs.shape)}"
            )
        check_batch("solve", {"a": tuple(a.shape[:-2]), "rhs": tuple(rhs.shape[:-1] if is_vector else rhs.shape[:-2])})
        a = prepare_symmetric(a, compute, "solve", self.name)
        rhs = rhs.detach().to(compute)
        check_finite(rhs, "solve", "rhs", self.name)
        if is_vector:
            return self._solve(a, rhs.unsqueeze(-1)).squeeze(-1)
        return self._solve(a, rhs)

    def damped_inv(
        self, a: Tensor, damping: float, dtype: Optional[torch.dtype] = None
    ) -> Tensor:
        """``(a + damping·I)⁻¹`` ``[..., n, n]`` for symmetric PSD ``a``, via Cholesky.

        ``a`` is positive semi-definite by contract, so what its rounding hides is taken as such: a
        ``damping > 0`` below the round-off of ``a``'s largest diagonal entry (``eps·max a_ii``, ``eps`` of
        the coarser of ``a``'s dtype and the compute dtype; per matrix of a batch) is raised to it, and where Cholesky still fails
        (round-off made ``a + damping·I`` indefinite: factors ~1e12 at damping 1e-3 in float32 did) the
        inverse comes from ``eigh`` with the eigenvalues clamped at 0, where every negative one is within the
        round-off ``√n·eps·max|λ|`` (a truly indefinite ``a`` is a :class:`LinalgError`). ``damping = 0`` is
        an exact inverse: a Cholesky failure is a :class:`LinalgError`.

        Args:
            a: ``[..., n, n]`` symmetric matrix (symmetrized first).
            damping: finite ``>= 0``, added to the diagonal in the compute dtype.
            dtype: compute dtype, see :meth:`eigh`.
        """
        damping = check_nonnegative_scalar(damping, "damping", "damped_inv")
        stored = a.dtype
        a = prepare_symmetric(a, dtype, "damped_inv", self.name)
        n = a.shape[-1]
        eps = coarsest_eps(a.dtype, stored)
        asked = damping
        eye = torch.eye(n, dtype=a.dtype, device=a.device)
        if damping > 0 and a.numel():  # per matrix of a batch: [..., 1, 1]
            damping = (a.diagonal(dim1=-2, dim2=-1).abs().amax(dim=-1) * eps).clamp_min_(damping)[..., None, None]
        damped = a + damping * eye
        try:
            return self._inv(damped)
        except LinalgError as exc:
            if asked > 0:
                try:
                    evals, evecs = self._eigh(a)
                except LinalgError:
                    pass
                else:  # only where the negative eigenvalues are round-off (√n·eps·max|λ|): a truly indefinite
                    # ``a`` is refused as before
                    top = evals.abs().amax(dim=-1, keepdim=True)
                    if bool((evals >= -math.sqrt(n) * eps * top).all()):
                        shift = damping[..., 0] if isinstance(damping, Tensor) else damping  # [..., 1]
                        out = (evecs / (evals.clamp_min(0.0) + shift).unsqueeze(-2)) @ evecs.transpose(-1, -2)
                        if bool(torch.isfinite(out).all()):
                            return out
            raise LinalgError(f"damped_inv(damping={asked:g}): {exc}") from exc

    def kron_eigen_solve(
        self,
        g_evals: Tensor,
        g_evecs: Tensor,
        a_evals: Tensor,
        a_evecs: Tensor,
        v: Tensor,
        damping: float,
        scale: float = 1.0,
    ) -> Tensor:
        """Solve with a damped Kronecker product given the factors' eigenbases.

        With ``G = Q_G diag(λ_G) Q_Gᵀ`` and ``A = Q_A diag(λ_A) Q_Aᵀ`` this returns::

            Q_G [ (Q_Gᵀ v Q_A) / (scale·λ_G λ_Aᵀ + damping) ] Q_Aᵀ

        which is ``(scale·G⊗A + damping·I)⁻¹ vec(v)`` for row-major ``vec``
        (``vec(v)[i·n_a + j] = v[i, j]``), reshaped back to ``[n_g, n_a]``.

        Args:
            g_evals: ``[..., n_g]`` eigenvalues of the output-gradient factor ``G``.
            g_evecs: ``[..., n_g, n_g]`` its eigenvectors (columns).
            a_evals: ``[..., n_a]`` eigenvalues of the input factor ``A``.
            a_evecs: ``[..., n_a, n_a]`` its eigenvectors (columns).
            v: ``[..., n_g, n_a]`` matrix to precondition (e.g. a weight gradient).
            damping: finite ``>= 0``, added to every eigenvalue of ``scale·G⊗A``.
            scale: finite ``>= 0`` multiplier of ``G⊗A`` (e.g. a dataset size).

        Returns:
            ``[..., n_g, n_a]`` in ``max(float32, dtypes of the inputs)``.

        Raises:
            LinalgError: non-finite input, or some ``scale·λ_G λ_Aᵀ + damping <= 0``
                (the damped product is not positive definite; clamp eigenvalues to
                ``>= 0`` or increase damping).
        """
        op = "kron_eigen_solve"
        damping = check_nonnegative_scalar(damping, "damping", op)
        scale = check_nonnegative_scalar(scale, "scale", op)
        n_g = check_square(g_evecs, op, "g_evecs")
        n_a = check_square(a_evecs, op, "a_evecs")
        if g_evals.ndim < 1 or g_evals.shape[-1] != n_g:
            raise ValueError(f"{op}: g_evals must be [..., {n_g}], got {tuple(g_evals.shape)}")
        if a_evals.ndim < 1 or a_evals.shape[-1] != n_a:
            raise ValueError(f"{op}: a_evals must be [..., {n_a}], got {tuple(a_evals.shape)}")
        if v.ndim < 2 or v.shape[-2:] != (n_g, n_a):
            raise ValueError(
                f"{op}: v must be [..., n_g, n_a] = [..., {n_g}, {n_a}], got {tuple(v.shape)}"
            )
        tensors = {"g_evals": g_evals, "g_evecs": g_evecs, "a_evals": a_evals,
                   "a_evecs": a_evecs, "v": v}
        check_batch(op, {k: tuple(t.shape[:-1] if k.endswith("evals") else t.shape[:-2]) for k, t in tensors.items()})
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
        compute = resolve_compute_dtype([t.dtype for t in tensors.values()], None, op)
        cast = {k: t.detach().to(compute) for k, t in tensors.items()}
        for k, t in cast.items():
            check_finite(t, op, k, self.name)
        return self._kron_eigen_solve(
            cast["g_evals"], cast["g_evecs"], cast["a_evals"], cast["a_evecs"], cast["v"],
            damping, scale,
        )

    # ------------------------------------------------------------- primitives
    @abc.abstractmethod
    def _eigh(self, a: Tensor) -> tuple[Tensor, Tensor]:
        """``(evals [..., n], evecs [..., n, n])`` of symmetric finite ``a``."""

    @abc.abstractmethod
    def _cholesky(self, a: Tensor) -> Tensor:
        """Lower Cholesky factor of symmetric finite ``a``; LinalgError if not PD."""

    @abc.abstractmethod
    def _inv(self, a: Tensor) -> Tensor:
        """Symmetric inverse of SPD ``a`` via Cholesky; LinalgError if not PD."""

    @abc.abstractmethod
    def _solve(self, a: Tensor, rhs: Tensor) -> Tensor:
        """``a⁻¹ rhs`` for SPD ``a`` ``[..., n, n]`` and ``rhs`` ``[..., n, k]``."""

    @abc.abstractmethod
    def _kron_eigen_solve(
        self, g_evals: Tensor, g_evecs: Tensor, a_evals: Tensor, a_evecs: Tensor,
        v: Tensor, damping: float, scale: float,
    ) -> Tensor:
        """See :meth:`kron_eigen_solve`; inputs validated and in one compute dtype."""
