"""A :class:`curvature.Curvature` as a ``scipy.sparse.linalg.LinearOperator`` (curvlinops' contract).

scipy is an optional dependency: imported here, when the operator is asked for.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    from .result import Curvature


def to_linear_operator(curv: "Curvature") -> Any:
    """``C`` as a symmetric ``LinearOperator`` of shape ``(P, P)`` and dtype float64; ``matvec``
    maps a numpy ``[P]`` (or ``[P, 1]``) vector to numpy ``[P]``, ``matmat`` ``[P, k]`` to ``[P, k]``."""
    try:
        from scipy.sparse.linalg import LinearOperator
    except ImportError as err:  # pragma: no cover - scipy is installed in the test environment
        raise ImportError("Curvature.to_scipy() needs scipy (pip install scipy)") from err
    dtype = curv.dtype
    device = next((t.device for b in curv.blocks.values() for t in b.tensors()), torch.device("cpu"))

    def real(x: np.ndarray) -> np.ndarray:
        # a contiguous, writable float64 copy where needed: torch takes no negative strides (x[::-1]) and
        # warns on every read-only array (np.frombuffer)
        x = np.asarray(x, dtype=np.float64)
        if not (x.flags.c_contiguous and x.flags.writeable):
            x = np.array(x, dtype=np.float64, order="C", copy=True)
        # numpy lives on the host: the vector goes to the curvature's device (a CUDA result) and back
        return curv.matvec(torch.from_numpy(x).to(device=device, dtype=dtype)).to(torch.float64).cpu().numpy()

    def apply(x: np.ndarray) -> np.ndarray:  # C is real: a complex vector's parts are mapped separately
        x = np.asarray(x)
        return real(x.real) + 1j * real(x.imag) if np.iscomplexobj(x) else real(x)

    def matvec(x: np.ndarray) -> np.ndarray:
        return apply(np.asarray(x).reshape(-1))

    def matmat(x: np.ndarray) -> np.ndarray:
        return apply(x)

    return LinearOperator(shape=curv.shape, matvec=matvec, rmatvec=matvec, matmat=matmat, dtype=np.float64)
