"""The NumPy backend: the CuPy code path (:class:`XpBackend`) run on the CPU.

Exists for tests and for CPU-only machines: it checks the array-module code that the
CuPy backend runs on the GPU. CPU tensors are exchanged without a copy through DLPack;
CUDA tensors are copied to the CPU and the results copied back.
"""
from __future__ import annotations

import numpy

from .xp_backend import ArrayBridge, XpBackend

__all__ = ["numpy_backend"]


def numpy_backend() -> XpBackend:
    """Return a backend running ``numpy.linalg`` (LAPACK) on CPU copies/views."""
    bridge = ArrayBridge(
        xp=numpy,
        device_type="cpu",
        errors=(numpy.linalg.LinAlgError,),
        copy_to_device=True,
    )
    return XpBackend("numpy", bridge)
