"""Linear-algebra backends of the curvature engine.

One interface (:class:`Backend`), three implementations:

- ``"torch"`` (default): :mod:`torch.linalg` on the tensor's own device;
- ``"cupy"``: ``cupy.linalg`` (cuSOLVER) on CUDA tensors, exchanged zero-copy via
  DLPack on torch's current stream;
- ``"numpy"``: the same array-module code as ``"cupy"`` run on the CPU, for tests.

Usage::

    from curvature.linalg import get_backend
    b = get_backend()              # TORCHSSO2_LINALG or "torch"
    evals, evecs = b.eigh(factor)  # ascending evals, computed in >= float32
    precond = b.kron_eigen_solve(g_evals, g_evecs, a_evals, a_evecs, grad, damping=1e-3)

See ``docs/linalg.md`` for the dtype policy, errors and benchmark results.
"""
from .base import Backend
from .errors import LinalgError
from .select import BACKEND_NAMES, DEFAULT_BACKEND, ENV_VAR, BackendName, get_backend

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_BACKEND",
    "ENV_VAR",
    "Backend",
    "BackendName",
    "LinalgError",
    "get_backend",
]
