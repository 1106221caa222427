"""One backend written against the array-module API shared by NumPy and CuPy.

:class:`XpBackend` is parametrized by an :class:`ArrayBridge` that names the array
module ``xp`` (``numpy`` or ``cupy``) and knows how to move tensors in and out of it
through DLPack. The math below is the same for both, so running the NumPy backend on
the CPU exercises exactly the code the CuPy backend runs on the GPU; only the bridge
(device, CUDA stream, error mode) differs.

Only ``xp.linalg.{eigh, cholesky, inv, solve}`` and elementwise/matmul operations are
used — no hand-written decompositions.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ContextManager

import torch
from torch import Tensor

from .base import Backend
from .errors import LinalgError, remedy

__all__ = ["ArrayBridge", "XpBackend"]

logger = logging.getLogger(__name__)

Array = Any  # numpy.ndarray or cupy.ndarray


@dataclass(frozen=True)
class ArrayBridge:
    """How an array module exchanges data with torch.

    Attributes:
        xp: the array module (``numpy`` or ``cupy``).
        device_type: torch device type the module's arrays live on (``"cpu"`` or
            ``"cuda"``).
        context: ``context(device)`` returns the context manager every call runs in
            (e.g. select the CUDA device and torch's current stream); the DLPack
            exchange and the computation both happen inside it.
        errors: exception types the module raises for failed decompositions; they
            are re-raised as :class:`LinalgError`.
        copy_to_device: if True, tensors on another device are copied to
            ``device_type`` (and results copied back); if False such tensors are an
            error.
    """

    xp: ModuleType
    device_type: str
    context: Callable[[torch.device], ContextManager[object]] = lambda device: contextlib.nullcontext()
    errors: tuple[type[BaseException], ...] = ()
    copy_to_device: bool = False

    def to_xp(self, t: Tensor, backend: str) -> Array:
        """Zero-copy view of ``t`` as an ``xp`` array (copy only across devices)."""
        if t.device.type != self.device_type:
            if not self.copy_to_device:
                raise ValueError(
                    f"{backend} backend works on {self.device_type} tensors, got a tensor "
                    f"on {t.device}; move it there or use the 'torch' backend"
                )
            logger.debug("%s backend: copying %s tensor to %s", backend, t.device, self.device_type)
            t = t.to(self.device_type)
        return self.xp.from_dlpack(t.detach())

    def to_torch(self, x: Array, device: torch.device) -> Tensor:
        """Zero-copy tensor view of ``x``, moved to ``device`` if it lives elsewhere."""
        t = torch.from_dlpack(x)
        return t if t.device == device else t.to(device)


class XpBackend(Backend):
    """Backend running ``xp.linalg`` (NumPy on CPU, CuPy on GPU) behind DLPack."""

    def __init__(self, name: str, bridge: ArrayBridge) -> None:
        self.name = name
        self._bridge = bridge

    @property
    def xp(self) -> ModuleType:
        """The array module this backend runs on."""
        return self._bridge.xp

    # ----------------------------------------------------------------- helpers
    def _run(self, op: str, a: Tensor, fn: Callable[..., Any], *tensors: Tensor) -> Any:
        """Run ``fn(*xp arrays)`` in the bridge context; map module errors."""
        try:
            return fn(*(self._bridge.to_xp(t, self.name) for t in tensors))
        except self._bridge.errors as exc:
            raise LinalgError(
                f"{op} ({self.name} backend) failed for input of shape {tuple(a.shape)} "
                f"and dtype {a.dtype}: {exc}; {remedy(a.dtype)}"
            ) from exc

    def _check_finite(self, op: str, a: Tensor, *arrays: Array) -> None:
        # CuPy may return NaN instead of raising; catch it here for every module.
        for x in arrays:
            if not bool(self.xp.isfinite(x).all()):
                raise LinalgError(
                    f"{op} ({self.name} backend) produced non-finite values for input of "
                    f"shape {tuple(a.shape)} and dtype {a.dtype} (matrix not positive "
                    f"definite, or the decomposition did not converge); {remedy(a.dtype)}"
                )

    def _mT(self, x: Array) -> Array:
        return self.xp.swapaxes(x, -1, -2)

    def _xp_cholesky(self, op: str, a: Tensor, x: Array) -> Array:
        factor = self.xp.linalg.cholesky(x)
        self._check_finite(op, a, factor)
        return factor

    # -------------------------------------------------------------- primitives
    def _eigh(self, a: Tensor) -> tuple[Tensor, Tensor]:
        def fn(x: Array) -> tuple[Tensor, Tensor]:
            evals, evecs = self.xp.linalg.eigh(x)
            self._check_finite("eigh", a, evals, evecs)
            return self._bridge.to_torch(evals, a.device), self._bridge.to_torch(evecs, a.device)

        with self._bridge.context(a.device):
            return self._run("eigh", a, fn, a)

    def _cholesky(self, a: Tensor) -> Tensor:
        def fn(x: Array) -> Tensor:
            return self._bridge.to_torch(self._xp_cholesky("cholesky", a, x), a.device)

        with self._bridge.context(a.device):
            return self._run("cholesky", a, fn, a)

    def _inv(self, a: Tensor) -> Tensor:
        def fn(x: Array) -> Tensor:
            factor_inv = self.xp.linalg.inv(self._xp_cholesky("inv", a, x))  # L⁻¹
            out = self._mT(factor_inv) @ factor_inv  # a⁻¹ = L⁻ᵀ L⁻¹
            out = (out + self._mT(out)) * 0.5
            self._check_finite("inv", a, out)
            return self._bridge.to_torch(out, a.device)

        with self._bridge.context(a.device):
            return self._run("inv", a, fn, a)

    def _solve(self, a: Tensor, rhs: Tensor) -> Tensor:
        def fn(x: Array, b: Array) -> Tensor:
            factor = self._xp_cholesky("solve", a, x)
            shape = tuple(torch.broadcast_shapes(factor.shape[:-2], b.shape[:-2]))
            factor = self.xp.broadcast_to(factor, shape + factor.shape[-2:])
            b = self.xp.broadcast_to(b, shape + b.shape[-2:])
            y = self.xp.linalg.solve(factor, b)  # L y = rhs
            out = self.xp.linalg.solve(self._mT(factor), y)  # Lᵀ x = y
            self._check_finite("solve", a, out)
            return self._bridge.to_torch(out, a.device)

        with self._bridge.context(a.device):
            return self._run("solve", a, fn, a, rhs)

    def _kron_eigen_solve(
        self, g_evals: Tensor, g_evecs: Tensor, a_evals: Tensor, a_evecs: Tensor,
        v: Tensor, damping: float, scale: float,
    ) -> Tensor:
        op = "kron_eigen_solve"

        def fn(lg: Array, qg: Array, la: Array, qa: Array, x: Array) -> Tensor:
            denom = scale * lg[..., :, None] * la[..., None, :] + damping
            if not bool((denom > 0).all()):
                raise LinalgError(
                    f"{op} ({self.name} backend): scale·λ_G λ_Aᵀ + damping has "
                    f"non-positive entries (min {float(denom.min()):.3g}, damping "
                    f"{damping:g}, scale {scale:g}); the damped Kronecker factor is not "
                    "positive definite — clamp the eigenvalues to >= 0 or increase damping"
                )
            rotated = self._mT(qg) @ x @ qa
            out = qg @ (rotated / denom) @ self._mT(qa)
            self._check_finite(op, v, out)
            return self._bridge.to_torch(out, v.device)

        with self._bridge.context(v.device):
            return self._run(op, v, fn, g_evals, g_evecs, a_evals, a_evecs, v)
