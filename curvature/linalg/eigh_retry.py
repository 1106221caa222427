"""A failed eigendecomposition is retried before it is reported.

LAPACK's float32 ``syevd`` can fail to converge or return NaN on ordinary, finite curvature
factors (a 401×401 K-FAC input factor of LeNet-5's fc1 at batch 32, on one thread). The matrix
is fine; float32 is not. :func:`eigh_with_retry` therefore tries, in order,

1. the requested compute dtype,
2. float64 (the result is cast back to the requested dtype),
3. float64 with a small jitter on the diagonal (``JITTER`` × the largest absolute diagonal
   entry, at least the smallest normal float64): the eigenvectors of ``a + εI`` are those
   of ``a`` and its eigenvalues are shifted by ``ε``, far below any damping in use,

and raises :class:`LinalgError` naming every attempt when all fail. A successful retry is
reported once per distinct matrix shape/dtype through :mod:`warnings` (Python shows a given
warning once) and every time at DEBUG level on this module's logger.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Callable, List, Tuple

import torch
from torch import Tensor

from .checks import all_finite
from .errors import LinalgError
from ..stacklevel import caller_stacklevel

logger = logging.getLogger(__name__)

#: relative jitter of the last attempt (× the largest absolute diagonal entry)
JITTER = 1e-10


class EighRetryWarning(RuntimeWarning):
    """An eigendecomposition failed in the requested dtype and succeeded in a retry."""


def _attempt(eigh: Callable[[Tensor], Tuple[Tensor, Tensor]], a: Tensor) -> Tuple[Tuple[Tensor, Tensor], str]:
    """``(result, "")`` or ``((), reason)`` for one try."""
    try:
        evals, evecs = eigh(a)
    except LinalgError as exc:
        return (), f"{exc}"
    # one sum and one host read for both (NaN/Inf reach the sum); the exact check only on doubt
    if not math.isfinite(float(evals.sum() + evecs.sum())) and not all_finite([evals, evecs]):
        return (), "non-finite eigenvalues or eigenvectors"
    return (evals, evecs), ""


def eigh_with_retry(eigh: Callable[[Tensor], Tuple[Tensor, Tensor]], a: Tensor, backend: str
                    ) -> Tuple[Tensor, Tensor]:
    """``eigh(a)`` for a symmetric, finite ``a`` ``[..., n, n]`` (already in its compute dtype),
    retried in float64 and then with jitter when it raises or returns non-finite values.

    Returns ``(evals [..., n], evecs [..., n, n])`` in ``a.dtype``.

    Raises:
        LinalgError: every attempt failed; the message lists them and what to try.
    """
    result, reason = _attempt(eigh, a)
    if result:
        return result
    tried: List[str] = [f"{a.dtype}: {reason}"]
    wide = a if a.dtype == torch.float64 else a.to(torch.float64)
    attempts = [] if a.dtype == torch.float64 else [("float64", wide)]
    diag_max = float(wide.diagonal(dim1=-2, dim2=-1).abs().max()) if wide.numel() else 0.0
    eps = max(JITTER * diag_max, torch.finfo(torch.float64).tiny)
    eye = torch.eye(wide.shape[-1], dtype=wide.dtype, device=wide.device)
    attempts.append((f"float64 with jitter {eps:.1e}·I", wide + eps * eye))
    for label, matrix in attempts:
        result, reason = _attempt(eigh, matrix)
        if result:
            evals, evecs = result
            if label != "float64":
                evals = evals - eps  # the eigenvalues of a, not of a + εI
            what = (f"eigh ({backend} backend) of a {tuple(a.shape)} {a.dtype} matrix failed "
                    f"({tried[0]}); recomputed in {label}")
            logger.debug("%s", what)
            warnings.warn(f"eigh ({backend} backend) of a {tuple(a.shape)} {a.dtype} matrix failed; recomputed in "
                          f"{label}. Pass decomposition_dtype=torch.float64 (SecondOrderOptimizer/VIOptimizer) "
                          "to decompose in double from the start.", EighRetryWarning, stacklevel=caller_stacklevel())
            evals = evals.to(a.dtype)
            if not all_finite([evals]):  # finite in float64, beyond the requested dtype's largest value
                raise LinalgError(f"eigh ({backend} backend): the eigenvalues of a {tuple(a.shape)} {a.dtype} matrix "
                                  f"exceed the largest {a.dtype} ({torch.finfo(a.dtype).max:.2e}; largest "
                                  f"{float(result[0].abs().max()):.2e} in float64): decompose in float64")
            return evals, evecs.to(a.dtype)
        tried.append(f"{label}: {reason}")
    raise LinalgError(f"eigh ({backend} backend) of a {tuple(a.shape)} matrix failed in every attempt ("
                      + "; ".join(tried) + "); increase damping or check the curvature for huge values")
