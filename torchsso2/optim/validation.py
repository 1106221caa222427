"""Argument checks shared by the optimizer faces: every error names the value and what was expected."""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Tuple

import numpy as np
import torch

from curvature.compute import SCALAR_OUTPUT
from curvature.options import did_you_mean

#: largest accepted learning rate: a natural-gradient step is O(1), so anything above is a typo (lr=1e39
#: is not even a float32)
MAX_LR = 1e6
#: largest accepted ``dataset_size``: VIOptimizer scales the curvature by N as a float; 2**53 is the
#: largest integer a float64 holds exactly (10**40 would overflow float32 statistics)
MAX_DATASET_SIZE = 2 ** 53
#: largest accepted VIOptimizer precision, damping, KL weighting or noise variance (and the inverse of the
#: smallest prior or noise variance): the largest float32. The posterior's arithmetic takes them as float32
#: scalars (beyond it every step overflowed, or a raw RuntimeError came halfway through a step)
MAX_VI_SCALE = float(torch.finfo(torch.float32).max)


def check_number(name: str, value: Any, *, low: float = -math.inf, high: float = math.inf,
                 low_open: bool = False, high_open: bool = False) -> float:
    """A finite real number in the given interval, as a Python float (bool is rejected; a NumPy scalar,
    e.g. ``np.float32`` from a schedule array, is taken as its value)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        hint = ""
        if isinstance(value, torch.Tensor) and value.numel() == 1:  # torch.optim takes a tensor lr (capturable)
            hint = " (a one-element tensor: pass a Python float, float(t); the step reads it on the host anyway)"
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}{hint}")
    try:
        v = float(value)
    except OverflowError:  # an int beyond the largest float (10**400)
        raise ValueError(f"{name}={value!r} must be finite (it is beyond the largest float)") from None
    if not math.isfinite(v):
        raise ValueError(f"{name}={value!r} must be finite")
    too_low = v <= low if low_open else v < low
    too_high = v >= high if high_open else v > high
    if too_low or too_high:
        lb = "(" if low_open or low == -math.inf else "["  # the infinities themselves are refused above
        rb = ")" if high_open or high == math.inf else "]"
        raise ValueError(f"{name}={value!r} is out of range; expected a value in {lb}{low}, {high}{rb}")
    return v


#: the largest step count or interval taken (2**53, the largest integer a float holds exactly): schedules
#: compute with them as floats (a default KL clip of 1e-3/√interval, an EMA decay to the interval's power)
MAX_STEPS = 2 ** 53


def check_int(name: str, value: Any, *, low: int = 1, high: Optional[int] = None) -> int:
    """An int >= ``low`` (and <= ``high`` when given; bool is rejected; a NumPy integer is taken as
    its Python int)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < low:
        raise ValueError(f"{name}={value!r} is invalid; expected an int >= {low}")
    if high is not None and value > high:
        raise ValueError(f"{name}={value!r} is invalid; expected an int in [{low}, {high}]")
    return value


def check_choice(name: str, value: Any, choices: Tuple[str, ...]) -> str:
    """One of the lower-case ``choices`` (a string of any case and surrounding spaces is taken); else a
    ValueError naming the value, the choices and the closest of them."""
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise ValueError(f"{name}={value!r} is not supported{did_you_mean(value, list(choices))}; expected one of "
                     f"{', '.join(map(repr, choices))}")


def unpack_closure_result(result: Any) -> Tuple[Any, Any, bool]:
    """``(loss, output, loss_only)`` of what a closure returned: ``(loss, output)`` (``loss_only``
    False), or the loss alone, as torch.optim's closures return it (a tensor of one element or a Python
    number; ``output`` None, ``loss_only`` True). Anything else is a TypeError saying what a closure
    returns."""
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise TypeError("the closure must return the loss, or (loss, output): the loss tensor and the model "
                            f"output; got a {type(result).__name__} of {len(result)} items")
        loss, output, loss_only = result[0], result[1], False
    elif isinstance(result, torch.Tensor) or (isinstance(result, numbers.Real) and not isinstance(result, bool)):
        loss, output, loss_only = result, None, True
    elif result is None:
        raise TypeError("the closure must return the loss (a tensor of one element), or (loss, output): the loss "
                        "tensor and the model output; got None (a closure without `return loss`; PyTorch "
                        "Lightning's training_step returning None to skip a batch is not supported: these "
                        "optimizers take a loss at every step)")
    else:
        raise TypeError("the closure must return the loss (a tensor of one element), or (loss, output): the loss "
                        f"tensor and the model output; got {type(result).__name__}")
    if not isinstance(loss, torch.Tensor) and (isinstance(loss, bool) or not isinstance(loss, numbers.Real)):
        raise TypeError(f"the closure's loss must be a tensor or a Python number, got {type(loss).__name__}")
    if isinstance(loss, torch.Tensor) and loss.numel() != 1:
        order = "the loss comes first in (loss, output)" if not loss_only else \
            "return the mean loss of the batch, e.g. loss.mean()"
        raise ValueError(f"the closure's loss must be a single number (the mean loss of the batch), got a tensor of "
                         f"shape {list(loss.shape)}; {order}")
    return loss, output, loss_only


def as_loss_tensor(loss: Any) -> "torch.Tensor":
    """A closure's loss given as a Python number, as a 0-dim float64 tensor (a tensor is returned as
    is); anything else is a TypeError naming what a closure must return."""
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
        raise TypeError(f"the closure's loss must be a tensor or a Python number, got {type(loss).__name__}")
    return torch.tensor(float(loss), dtype=torch.float64)


def check_nonempty_batch(output: Any) -> None:
    """The model output of a closure's forward must hold at least one example (``[N, ...]``, N >= 1)."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        raise ValueError(SCALAR_OUTPUT)
    if isinstance(output, torch.Tensor) and output.shape[0] == 0:
        raise ValueError(f"the closure ran the model on an empty batch (output of shape {list(output.shape)}); "
                         "the curvature of an empty batch is undefined: skip empty batches in the training loop "
                         "(e.g. DataLoader(..., drop_last=True) or `if len(x) == 0: continue`; with several processes every rank "
                         "must skip the same steps, as drop_last=True with a DistributedSampler does)")


def dtype_named(value: Any) -> Any:
    """A dtype given by its name, as a config file gives it (``"float64"``, ``"torch.float64"``): the
    ``torch.dtype``; anything else is returned as it is (for the caller's check to name)."""
    if isinstance(value, str):
        name = value.strip()
        candidate = getattr(torch, name[len("torch."):] if name.startswith("torch.") else name, None)
        if isinstance(candidate, torch.dtype):
            return candidate
    return value
