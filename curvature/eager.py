"""``eager(fn)``: ``torch.compiler.disable(fn)`` without importing ``torch._dynamo`` until it matters.

``torch.compiler.disable`` imports ``torch._dynamo`` (about a second, as long as ``import torch``)
when it is applied, so decorating at module level made ``import torchsso2`` twice as slow. ``eager``
calls ``fn`` directly while ``torch._dynamo`` has not been imported (then nothing can be compiling
the call); once it has, the call goes through ``torch.compiler.disable(fn)``, made at the first such
call, so a compiled function that calls it breaks its graph there and runs ``fn`` eagerly (dynamo
traces the thin wrapper itself, one graph break more than a bare ``torch.compiler.disable``).
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, List, TypeVar

import torch

__all__ = ["eager"]

F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """``fn``, run eagerly under ``torch.compile`` (see the module docstring)."""
    disabled: List[Callable[..., Any]] = []  # torch.compiler.disable(fn), made at the first call that needs it

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:  # nothing imported dynamo: nothing is compiling this call
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return wrapper  # type: ignore[return-value]
