"""Errors that name the way out when a PyTorch-SSO call reaches the native optimizers."""
from __future__ import annotations

from typing import Any


def check_not_pytorch_sso_call(lr: Any, optimizer: str) -> None:
    """A string where the learning rate goes is PyTorch-SSO's positional ``curv_type``
    (``SecondOrderOptimizer(model, "Fisher", curv_shapes, curv_kwargs)``): raise TypeError
    pointing at :mod:`torchsso2.compat.pytorch_sso`, which converts such calls."""
    if isinstance(lr, str):
        raise TypeError(
            f"{optimizer}: lr must be a real number, got str {lr!r}; this looks like PyTorch-SSO's "
            f"{optimizer}(model, curv_type, curv_shapes, curv_kwargs, ...) signature: use "
            f"torchsso2.compat.pytorch_sso.{optimizer}, which takes it and converts its numbers, or "
            f"the native keyword arguments (curvature=..., approx=...; see docs/migrating.md)")
