"""Argument checks shared by the optimizer faces: every error names the value and what was expected."""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

#: largest accepted learning rate: a natural-gradient step is O(1), so anything above is a typo (lr=1e39
#: is not even a float32)
MAX_LR = 1e6
#: largest accepted ``dataset_size``: VIOptimizer scales the curvature by N as a float; 2**53 is the
#: largest integer a float64 holds exactly (10**40 would overflow float32 statistics)
MAX_DATASET_SIZE = 2 ** 53


def check_number(name: str, value: Any, *, low: float = -math.inf, high: float = math.inf,
                 low_open: bool = False, high_open: bool = False) -> float:
    """A finite real number in the given interval (bool is rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name}={value!r} must be finite")
    too_low = v <= low if low_open else v < low
    too_high = v >= high if high_open else v > high
    if too_low or too_high:
        lb = "(" if low_open else "["
        rb = ")" if high_open else "]"
        raise ValueError(f"{name}={value!r} is out of range; expected a value in {lb}{low}, {high}{rb}")
    return v


def check_int(name: str, value: Any, *, low: int = 1, high: Optional[int] = None) -> int:
    """An int >= ``low`` (and <= ``high`` when given; bool is rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name}={value!r} is invalid; expected an int >= {low}")
    if high is not None and value > high:
        raise ValueError(f"{name}={value!r} is invalid; expected an int in [{low}, {high}]")
    return value


def check_choice(name: str, value: Any, choices: Tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {', '.join(map(repr, choices))}")
    return value


def unpack_closure_result(result: Any) -> Tuple[Any, Any]:
    """A closure must return ``(loss, output)``; anything else is a TypeError saying so."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError("the closure must return (loss, output): the loss tensor and the model output, "
                        f"got {type(result).__name__}")
    return result[0], result[1]
