"""The mark on the hook functions a curvature capture registers on modules.

:meth:`curvature.capture.Capture.foreign_hooks` tells a user's hooks from the captures' own by it
(several captures may be active at once: the optimizer's and the low-rank solver's recorder).
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

#: the attribute set on a capture's hook functions
CAPTURE_HOOK = "_curvature_capture_hook"

F = TypeVar("F", bound=Callable[..., Any])


def capture_hook(fn: F) -> F:
    """Mark ``fn`` as a capture's hook; returns it."""
    setattr(fn, CAPTURE_HOOK, True)
    return fn


def is_marked(fn: Any) -> bool:
    """Whether ``fn`` was marked by :func:`capture_hook`."""
    return bool(getattr(fn, CAPTURE_HOOK, False))
