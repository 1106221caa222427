"""Hyper-parameters that may be numbers or callables of the K-FAC step, and their checks.

Every check raises ``ValueError`` (bad value) or ``TypeError`` (bad type) naming the argument,
the value and what was expected. Callables are checked when they are evaluated.

The rules are kfac_pytorch's, with one widening for callables: ``factor_decay`` returned by
a callable may be ``0`` (replace the factors by the new batch), because kfac_pytorch's own
:func:`exp_decay_factor_averaging` returns ``0.0`` at steps 0 and 1. A constant
``factor_decay`` must be in ``(0, 1]`` as in kfac_pytorch. ``kl_clip=None`` is a
``TypeError`` in the constructor, as in kfac_pytorch; a callable returning ``None`` turns the
KL clip off for that step.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Optional, Union

import torch

from curvature.options import float_or_inf

__all__ = ["ClipSchedule", "Schedule", "as_number", "check_schedule", "check_value", "evaluate", "exp_decay_factor_averaging"]

#: a hyper-parameter: a number (a one-element tensor too) or a callable of the step giving one
Schedule = Union[Callable[[int], float], float, int, torch.Tensor]
#: ``kl_clip``: a callable may also return None (no clipping at that step)
ClipSchedule = Union[Callable[[int], Optional[float]], float, int, torch.Tensor]

# name -> (predicate, description of the expected range, integer?)
RULES = {
    "factor_update_steps": (lambda v: v > 0, "an int > 0", True),
    "inv_update_steps": (lambda v: v > 0, "an int > 0", True),
    "damping": (lambda v: v > 0, "a float > 0", False),
    "factor_decay": (lambda v: 0 < v <= 1, "a float in (0, 1]", False),
    "kl_clip": (lambda v: v > 0, "a float > 0", False),
    "lr": (lambda v: v >= 0, "a float >= 0", False),
}


# rules for values returned by callables, where they differ from RULES
CALLABLE_RULES = {
    "factor_decay": (lambda v: 0 <= v <= 1, "a float in [0, 1]", False),
    "kl_clip": (lambda v: v > 0, "a float > 0 (or None for no clipping)", False),
}


def as_number(value: object) -> object:
    """A one-element tensor (``damping=torch.tensor(0.01)``, an lr kept as a tensor by torch.optim)
    as its Python number; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        return value.item()
    return value


def _check_number(name: str, value: object, from_callable: bool = False) -> None:
    pred, expected, integer = CALLABLE_RULES.get(name, RULES[name]) if from_callable else RULES[name]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected} or a callable of the step, got {type(value).__name__} {value!r}")
    number = float_or_inf(value)
    if integer and not isinstance(value, numbers.Integral) and not number.is_integer():
        raise TypeError(f"{name} must be {expected} or a callable of the step, got {value!r}")
    whole = integer and isinstance(value, numbers.Integral)  # an int step count of any size is an int
    if not (whole or math.isfinite(number)) or not pred(value):
        raise ValueError(f"{name} must be {expected} or a callable of the step, got {value!r}")


def check_value(name: str, value: object, from_callable: bool = False) -> None:
    """Check one value of hyper-parameter ``name`` (``from_callable``: the rules for a value a
    callable or a scheduler produced)."""
    _check_number(name, value, from_callable)


def check_schedule(name: str, value: object) -> None:
    """Check a hyper-parameter given as a number (callables are checked at evaluation)."""
    if callable(value):
        return
    if name == "kl_clip" and value is None:
        raise TypeError("kl_clip must be a float > 0 or a callable of the step, got None (as in kfac_pytorch); "
                        "for no KL clipping pass kl_clip=lambda step: None")
    _check_number(name, value)


def evaluate(name: str, value: Schedule, step: int) -> float:
    """The value of ``value`` at ``step`` (calls it if callable), checked; a one-element tensor as its
    Python number.

    A number is checked too, by the rules for a callable's value: the constructor checked the one it was
    given, but kfac_pytorch's :class:`LambdaParamScheduler` and users set the attributes (``_damping``,
    ``_lr``, ...) between steps, and a NaN or negative one would otherwise give wrong steps silently."""
    pred, _, integer = CALLABLE_RULES.get(name, RULES[name])
    given = not callable(value)
    if given:
        if (type(value) is int and integer and value > 0) or \
                (type(value) is float and not integer and math.isfinite(value) and pred(value)):
            return value  # the common cases, checked without the general path
        out, origin = as_number(value), f"its value at step {step}, set after construction"
    else:
        out, origin = as_number(value(step)), f"returned by the callable at step {step}"
    if name == "kl_clip" and out is None:
        return out  # type: ignore[return-value]  # no clipping (a callable's None, or set so between steps)
    try:
        _check_number(name, out, from_callable=True)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{exc} ({origin})") from None
    if given:  # an int given for a float setting (damping=10**30) as a float: torch ops take no int beyond int64
        # (a step count of 2.0 is kept as given, as kfac_pytorch keeps it)
        return float(out) if isinstance(out, int) and not integer else out  # type: ignore[return-value]
    return int(out) if integer else out  # type: ignore[return-value]


def exp_decay_factor_averaging(min_value: float = 0.95) -> Callable[[int], float]:
    """Running-average weight schedule of Martens & Grosse (2015), kfac_pytorch's helper.

    Returns ``f(step) = min(1 - 1/k, min_value)`` with ``k = max(step, 1)``: ``0.0`` at steps 0
    and 1 (the factors are replaced by the first batch), then rising to ``min_value``. Pass it
    as ``factor_decay``.

    Raises:
        ValueError: ``min_value <= 0``; or, when called, a negative ``step``.
    """
    if min_value <= 0:
        raise ValueError(f"min_value must be greater than 0, got {min_value!r}")

    def factor_weight(step: int) -> float:
        if step < 0:
            raise ValueError(f"step value cannot be negative. Got step={step}.")
        return min(1 - 1 / max(step, 1), min_value)

    return factor_weight
