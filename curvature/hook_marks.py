"""The mark on the hook functions a curvature capture registers on modules.

:meth:`curvature.capture.Capture.foreign_hooks` tells a user's hooks from the captures' own by it
(several captures may be active at once: the optimizer's and the low-rank solver's recorder).
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

#: the attribute set on a capture's hook functions
CAPTURE_HOOK = "_curvature_capture_hook"

F = TypeVar("F", bound=Callable[..., Any])


def capture_hook(fn: F) -> F:
    """Mark ``fn`` as a capture's hook; returns it."""
    setattr(fn, CAPTURE_HOOK, True)
    return fn


def in_func_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``: per-sample gradients of
    ``functional_call(model, ...)`` in a closure, for logging) is running: a forward inside one is not
    the batch's forward, and its tensors live only inside the transform, so the hooks leave it alone.
    False while torch.compile traces (its tracing runs under an interpreter of its own)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


def is_marked(fn: Any) -> bool:
    """Whether ``fn`` was marked by :func:`capture_hook`."""
    return bool(getattr(fn, CAPTURE_HOOK, False))
