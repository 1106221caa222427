"""The NumPy backend: the CuPy code path (:class:`XpBackend`) run on the CPU.

Exists for tests and for CPU-only machines: it checks the array-module code that the
CuPy backend runs on the GPU. CPU tensors are exchanged without a copy through DLPack;
CUDA tensors are copied to the CPU and the results copied back.

NumPy's BLAS/LAPACK (OpenBLAS) keeps its own thread pool, sized to all cores and blind to
``torch.set_num_threads``. Every call therefore runs with the BLAS pool limited to torch's
intra-op thread count (through ``threadpoolctl`` when it is installed — it comes with
scikit-learn; without it, set ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS``): a process told to
use one thread uses one. Measured on a loaded 2-core machine, 30 K-FAC steps of a small
conv net with ``linalg="numpy"`` and ``torch.set_num_threads(1)``: 83 s with OpenBLAS's own
two threads, 5.4 s with one.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import numpy
import torch

from .xp_backend import ArrayBridge, XpBackend

__all__ = ["numpy_backend"]


def _blas_pool() -> Optional[Any]:
    """threadpoolctl's handle on the BLAS libraries loaded now (numpy's OpenBLAS), or None."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    pool = ThreadpoolController().select(user_api="blas")
    return pool if pool.lib_controllers else None


def blas_threads_like_torch(pool: Optional[Any]) -> ContextManager[object]:
    """Limit ``pool`` (:func:`_blas_pool`) to ``torch.get_num_threads()`` threads for the duration (~10 µs)."""
    if pool is None:
        return contextlib.nullcontext()
    return pool.limit(limits=torch.get_num_threads())


def numpy_backend() -> XpBackend:
    """Return a backend running ``numpy.linalg`` (LAPACK) on CPU copies/views, with NumPy's BLAS
    threads limited to torch's intra-op thread count."""
    pool = _blas_pool()
    bridge = ArrayBridge(
        xp=numpy,
        device_type="cpu",
        context=lambda device: blas_threads_like_torch(pool),
        errors=(numpy.linalg.LinAlgError,),
        copy_to_device=True,
    )
    return XpBackend("numpy", bridge)
