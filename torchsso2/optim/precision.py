"""The optimizer's own arithmetic runs outside ``torch.autocast``.

Under ``torch.autocast`` matmuls run in bfloat16/float16 and mix badly with the float32
statistics and decompositions the optimizer keeps (``torch.mv`` of a float32 eigenbasis and an
autocast bfloat16 product raises "addmv input tensors must have the same dtype"), and a
bfloat16 solve would lose the precision the curvature is kept in. So :func:`full_precision_step`
runs a ``step`` with autocast disabled, and the user's closure — the forward and backward the
user wrote for that autocast context — with the caller's autocast settings restored.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional, Tuple, TypeVar

import torch
from curvature.eager import eager

#: device types whose autocast state is saved and restored
DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")

AutocastState = Tuple[Tuple[str, torch.dtype], ...]
F = TypeVar("F", bound=Callable[..., Any])


def autocast_state() -> AutocastState:
    """``((device_type, dtype), ...)`` of every device type whose autocast is enabled now."""
    state = []
    for dev in DEVICE_TYPES:
        try:
            if torch.is_autocast_enabled(dev):
                state.append((dev, torch.get_autocast_dtype(dev)))
        except (RuntimeError, ValueError):  # a device type this build does not know
            continue
    return tuple(state)


@contextlib.contextmanager
def without_autocast(state: Optional[AutocastState] = None) -> Iterator[None]:
    """Disable autocast for the device types of ``state`` (default: those enabled now)."""
    state = autocast_state() if state is None else state
    with contextlib.ExitStack() as stack:
        for dev, _ in state:
            stack.enter_context(torch.autocast(dev, enabled=False))
        yield


@contextlib.contextmanager
def with_autocast(state: AutocastState) -> Iterator[None]:
    """Re-enable autocast as recorded in ``state`` (nothing when it is empty)."""
    with contextlib.ExitStack() as stack:
        for dev, dtype in state:
            stack.enter_context(torch.autocast(dev, dtype=dtype))
        yield


def full_precision_step(step: F) -> F:
    """Decorate an optimizer's ``step(closure, ...)``: its body runs without autocast, the closure
    under the autocast settings of the caller (a step outside any autocast context is unchanged).
    Inside an autocast context each closure call starts, and the step ends, by clearing autocast's
    cache of low-precision weight copies: the parameters change in place (the update; VIOptimizer's
    weight samples), and a context spanning the training loop would otherwise run the next
    forwards on copies of old weights (torch clears the cache only when the outermost context exits).

    The step runs eagerly under ``torch.compile`` (``torch.compiler.disable``: a compiled function that
    calls it breaks its graph there, and the closure runs eagerly too): dynamo does not trace the
    step's in-place swaps of parameter data (VI's weight samples) and its fused momentum kernel
    (``torch._fused_sgd_``, which inductor cannot run on fake tensors) correctly."""
    @functools.wraps(step)
    def wrapper(self: Any, closure: Any = None, *args: Any, **kwargs: Any) -> Any:
        state = autocast_state()
        if not state:
            return step(self, closure, *args, **kwargs)
        if callable(closure):
            user_closure = closure

            def closure() -> Any:
                torch.clear_autocast_cache()  # weights changed since the last forward (a sampled VI weight)
                with with_autocast(state):
                    return user_closure()
        try:
            with without_autocast(state):
                return step(self, closure, *args, **kwargs)
        finally:
            torch.clear_autocast_cache()
    return eager(wrapper)  # type: ignore[return-value]
