"""The default backend: ``torch.linalg`` on the tensor's own device (CPU or CUDA)."""
from __future__ import annotations

from torch import Tensor
import torch

from .base import Backend
from .checks import all_finite
from .errors import LinalgError, remedy

__all__ = ["TorchBackend"]


def _describe(a: Tensor) -> str:
    return f"shape {tuple(a.shape)}, dtype {a.dtype}, device {a.device}"


class TorchBackend(Backend):
    """Backend built on :mod:`torch.linalg` (LAPACK on CPU, cuSOLVER/MAGMA on CUDA)."""

    name = "torch"

    def _eigh(self, a: Tensor) -> tuple[Tensor, Tensor]:
        try:
            return torch.linalg.eigh(a)
        except RuntimeError as exc:  # torch.linalg.LinAlgError subclasses RuntimeError
            raise LinalgError(
                f"eigh (torch backend) failed for input with {_describe(a)}: {exc}; "
                "try dtype=torch.float64 or more damping"
            ) from exc

    def _cholesky(self, a: Tensor) -> Tensor:
        factor, info = torch.linalg.cholesky_ex(a)
        failed = info.reshape(-1) != 0
        if bool(failed.any()):
            index = int(torch.nonzero(failed)[0])
            order = int(info.reshape(-1)[index])
            where = f"matrix {index} of the batch" if a.ndim > 2 else "matrix"
            raise LinalgError(
                f"cholesky (torch backend): {where} ({_describe(a)}) is not positive "
                f"definite (leading minor of order {order} failed); {remedy(a.dtype)}"
            )
        return factor

    def _inv(self, a: Tensor) -> Tensor:
        return _finite("inv", a, torch.cholesky_inverse(self._cholesky(a)))

    def _solve(self, a: Tensor, rhs: Tensor) -> Tensor:
        return _finite("solve", a, torch.cholesky_solve(rhs, self._cholesky(a)))

    def _kron_eigen_solve(
        self, g_evals: Tensor, g_evecs: Tensor, a_evals: Tensor, a_evecs: Tensor,
        v: Tensor, damping: float, scale: float,
    ) -> Tensor:
        denom = scale * g_evals.unsqueeze(-1) * a_evals.unsqueeze(-2) + damping
        if not bool((denom > 0).all()):
            raise LinalgError(
                "kron_eigen_solve (torch backend): scale·λ_G λ_Aᵀ + damping has "
                f"non-positive entries (min {float(denom.min()):.3g}, damping {damping:g}, "
                f"scale {scale:g}); the damped Kronecker factor is not positive "
                "definite — clamp the eigenvalues to >= 0 or increase damping"
            )
        rotated = g_evecs.mT @ v @ a_evecs
        return _finite("kron_eigen_solve", v, g_evecs @ (rotated / denom) @ a_evecs.mT)


def _finite(op: str, a: Tensor, out: Tensor) -> Tensor:
    """``out``, or LinalgError when it holds NaN/Inf (a finite input whose result overflows the dtype,
    e.g. solving with a tiny matrix in float32), as the NumPy/CuPy backend reports it."""
    if not all_finite([out]):
        raise LinalgError(
            f"{op} (torch backend) produced non-finite values for input of shape {tuple(a.shape)} and dtype "
            f"{a.dtype} (a result beyond the dtype's range: the matrix is too close to singular); {remedy(a.dtype)}")
    return out
