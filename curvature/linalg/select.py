"""Choosing a backend by name, by environment variable, or by default."""
from __future__ import annotations

import logging
import os
from typing import Callable, Literal, Union

from ..options import did_you_mean

from .base import Backend
from .cupy_backend import cupy_backend
from .numpy_backend import numpy_backend
from .torch_backend import TorchBackend

__all__ = ["BACKEND_NAMES", "BackendName", "DEFAULT_BACKEND", "ENV_VAR", "get_backend"]

logger = logging.getLogger(__name__)

BackendName = Literal["torch", "cupy", "numpy"]

#: Every valid backend name.
BACKEND_NAMES: tuple[BackendName, ...] = ("torch", "cupy", "numpy")

#: Environment variable read when no name is given.
ENV_VAR = "TORCHSSO2_LINALG"

#: Backend used when neither a name nor the environment variable is given.
DEFAULT_BACKEND: BackendName = "torch"



def get_backend(name: Union[str, Backend, None] = None) -> Backend:
    """Return a (new, stateless) linear-algebra backend.

    Args:
        name: ``"torch"`` (default: ``torch.linalg`` on the tensor's device),
            ``"cupy"`` (cuSOLVER via CuPy, CUDA tensors only, zero-copy) or
            ``"numpy"`` (the CuPy code path on the CPU, for tests). Case and
            surrounding spaces are ignored. ``None`` reads the environment variable
            ``TORCHSSO2_LINALG`` and falls back to ``"torch"`` when it is unset or
            empty. A :class:`Backend` instance is returned unchanged.

    Raises:
        ValueError: unknown name (the message names it and the choices).
        TypeError: neither a name, None nor a Backend.
        ImportError: ``"cupy"`` requested but CuPy is not installed.
        RuntimeError: ``"cupy"`` requested but no CUDA device is usable.
    """
    if isinstance(name, Backend):
        return name
    source = "the linalg argument"
    if name is None:
        env = os.environ.get(ENV_VAR, "").strip()
        name, source = (env, f"environment variable {ENV_VAR}") if env else (DEFAULT_BACKEND, "default")
    if not isinstance(name, str):
        raise TypeError(
            f"linalg must be a backend name in {BACKEND_NAMES}, None or a Backend, got {type(name).__name__} {name!r}"
        )
    key = name.strip().lower()
    factories: dict[str, Callable[[], Backend]] = {
        "torch": TorchBackend,
        "cupy": cupy_backend,
        "numpy": numpy_backend,
    }
    if key not in factories:
        raise ValueError(
            f"unknown linalg backend {name!r} (from {source}){did_you_mean(name, list(BACKEND_NAMES))}; expected one of "
            f"{BACKEND_NAMES}"
        )
    if source != "the linalg argument":  # resolved from the environment or the default: said once per resolution
        logger.debug("linalg backend %r selected (from %s)", key, source)
    return factories[key]()
