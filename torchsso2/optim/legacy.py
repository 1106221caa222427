"""Errors that name the way out when a PyTorch-SSO call reaches the native optimizers."""
from __future__ import annotations

from typing import Any

#: PyTorch-SSO's ``curv_type`` values (lower case): the third positional argument of its optimizers
PYTORCH_SSO_CURV_TYPES = ("cov", "fisher", "hessian")


def check_not_pytorch_sso_call(lr: Any, optimizer: str) -> None:
    """PyTorch-SSO's ``curv_type`` where the learning rate goes is its positional signature
    (``SecondOrderOptimizer(model, "Fisher", curv_shapes, curv_kwargs)``): raise TypeError
    pointing at :mod:`torchsso2.compat.pytorch_sso`, which converts such calls."""
    if isinstance(lr, str) and lr.lower() in PYTORCH_SSO_CURV_TYPES:
        raise TypeError(
            f"{optimizer}: lr must be a real number, got str {lr!r}; this looks like PyTorch-SSO's "
            f"{optimizer}(model, curv_type, curv_shapes, curv_kwargs, ...) signature: use "
            f"torchsso2.compat.pytorch_sso.{optimizer}, which takes it and converts its numbers, or "
            f"the native keyword arguments (curvature=..., approx=...; see docs/migrating.md)")
