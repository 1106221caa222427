"""Hyper-parameters that may be numbers or callables of the K-FAC step, and their checks.

Every check raises ``ValueError`` (bad value) or ``TypeError`` (bad type) naming the argument,
the value and what was expected. Callables are checked when they are evaluated.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Union

__all__ = ["Schedule", "check_schedule", "evaluate"]

Schedule = Union[Callable[[int], float], float, int]

# name -> (predicate, description of the expected range, integer?)
RULES = {
    "factor_update_steps": (lambda v: v > 0, "an int > 0", True),
    "inv_update_steps": (lambda v: v > 0, "an int > 0", True),
    "damping": (lambda v: v > 0, "a float > 0", False),
    "factor_decay": (lambda v: 0 < v <= 1, "a float in (0, 1]", False),
    "kl_clip": (lambda v: v > 0, "a float > 0 (or None for no clipping)", False),
    "lr": (lambda v: v >= 0, "a float >= 0", False),
}


def _check_number(name: str, value: object) -> None:
    pred, expected, integer = RULES[name]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected} or a callable of the step, got {type(value).__name__} {value!r}")
    if integer and not float(value).is_integer():
        raise TypeError(f"{name} must be {expected} or a callable of the step, got {value!r}")
    if not math.isfinite(float(value)) or not pred(value):
        raise ValueError(f"{name} must be {expected} or a callable of the step, got {value!r}")


def check_schedule(name: str, value: object) -> None:
    """Check a hyper-parameter given as a number (callables are checked at evaluation)."""
    if callable(value) or (name == "kl_clip" and value is None):
        return
    _check_number(name, value)


def evaluate(name: str, value: Schedule, step: int) -> float:
    """The value of ``value`` at ``step`` (calls it if callable), checked."""
    if not callable(value):
        return value  # type: ignore[return-value]
    out = value(step)
    if name == "kl_clip" and out is None:
        return out  # type: ignore[return-value]
    try:
        _check_number(name, out)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{exc} (returned by the callable at step {step})") from None
    return int(out) if RULES[name][2] else out  # type: ignore[return-value]
