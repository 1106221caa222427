"""The CuPy backend: :class:`XpBackend` on the GPU, zero-copy through DLPack.

Tensors are viewed as CuPy arrays with ``cupy.from_dlpack`` and results viewed back
with ``torch.from_dlpack`` — no copies. Every call runs on the tensor's own CUDA device
and on torch's *current* CUDA stream (wrapped with ``cupy.cuda.ExternalStream``), so it
is ordered with the surrounding torch work without extra synchronization. cuSOLVER
failures are made to raise (``cupyx.errstate(linalg="raise")``) instead of silently
returning NaN; that check synchronizes the stream, as torch's own checks do.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from types import ModuleType
from typing import Iterator

import numpy
import torch

from .xp_backend import ArrayBridge, XpBackend

__all__ = ["cupy_backend"]

logger = logging.getLogger(__name__)

_HINT = "use the default backend 'torch' (get_backend('torch') or unset TORCHSSO2_LINALG)"


@contextlib.contextmanager
def _cuda_stream_context(
    cupy: ModuleType, cupyx: ModuleType, device: torch.device
) -> Iterator[None]:
    """Select ``device`` and torch's current stream on it for CuPy; raise on errors."""
    if device.type != "cuda":  # let the bridge raise its clear wrong-device error
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream), \
            cupyx.errstate(linalg="raise"):
        yield


def cupy_backend() -> XpBackend:
    """Return a backend running ``cupy.linalg`` (cuSOLVER) on CUDA tensors.

    Raises:
        ImportError: CuPy is not installed.
        RuntimeError: CuPy cannot be used (import failed, or no CUDA device).
    """
    try:
        import cupy
        import cupyx
    except ImportError as exc:
        raise ImportError(
            "linalg backend 'cupy' needs CuPy, which is not installed "
            f"(pip install cupy-cuda12x, matching your CUDA version); or {_HINT}"
        ) from exc
    except Exception as exc:  # broken CUDA libraries surface as various errors
        raise RuntimeError(f"linalg backend 'cupy': importing CuPy failed ({exc}); {_HINT}") from exc
    if not torch.cuda.is_available():
        raise RuntimeError(
            "linalg backend 'cupy' needs a CUDA GPU, but torch.cuda.is_available() is "
            f"False (CPU-only torch build or no visible device); {_HINT}"
        )
    try:
        n_devices = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise RuntimeError(f"linalg backend 'cupy': CuPy cannot see a CUDA device ({exc}); {_HINT}") from exc
    if n_devices == 0:
        raise RuntimeError(f"linalg backend 'cupy': CuPy sees no CUDA device; {_HINT}")
    errors = {numpy.linalg.LinAlgError, getattr(cupy.linalg, "LinAlgError", numpy.linalg.LinAlgError)}
    bridge = ArrayBridge(
        xp=cupy,
        device_type="cuda",
        context=functools.partial(_cuda_stream_context, cupy, cupyx),
        errors=tuple(errors),
        copy_to_device=False,
    )
    logger.debug("cupy backend: CuPy %s, %d CUDA device(s)", cupy.__version__, n_devices)
    return XpBackend("cupy", bridge)
