"""Argument checks of ``KFACPreconditioner`` that follow kfac_pytorch's rules.

* :func:`resolve_grad_worker_fraction`: ``grad_worker_fraction`` (a float in ``[0, 1]`` or a
  ``DistributedStrategy``, ours or kfac_pytorch's) to the float fraction and the
  ``DistributedStrategy`` that kfac_pytorch reports for it.
* :func:`check_dtype`: a floating ``torch.dtype``.
"""
from __future__ import annotations

import numbers
from enum import Enum
from typing import Optional, Tuple, Union

import torch

from curvature.options import float_or_inf
from torchsso2.optim.validation import dtype_named

from .enums import DistributedStrategy, parse_choice

__all__ = ["check_dtype", "resolve_grad_worker_fraction"]


def resolve_grad_worker_fraction(value: Union[DistributedStrategy, Enum, float],
                                 world_size: int) -> Tuple[float, DistributedStrategy]:
    """``(fraction, strategy)`` for ``grad_worker_fraction`` in a world of ``world_size`` ranks.

    As kfac_pytorch: ``COMM_OPT`` → 1, ``HYBRID_OPT`` → 0.5, ``MEM_OPT`` → ``1/world_size``
    (the strategy is the member given); a float ``f`` in ``[0, 1]`` (``0`` means
    ``1/world_size``) is ``COMM_OPT`` if ``f == 1``, ``MEM_OPT`` if ``f <= 1/world_size``,
    else ``HYBRID_OPT``. Whether ``world_size·f`` gives equal groups is checked by the
    work assignment (``ValueError``).

    Raises:
        ValueError: a float outside ``[0, 1]``.
        TypeError: neither a number nor a ``DistributedStrategy``.
    """
    if isinstance(value, Enum):
        strategy = parse_choice(value, DistributedStrategy, "grad_worker_fraction")
        return strategy.fraction(world_size), strategy
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"grad_worker_fraction must be a DistributedStrategy or a float in [0, 1], "
                        f"got {type(value).__name__} {value!r}")
    fraction = float_or_inf(value)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"grad_worker_fraction must be in [0, 1] (0 means 1/world_size), got {value!r}")
    if fraction == 0.0:
        fraction = 1.0 / world_size
    if fraction == 1.0:
        return 1.0, DistributedStrategy.COMM_OPT
    if fraction <= 1.0 / world_size:
        return fraction, DistributedStrategy.MEM_OPT
    return fraction, DistributedStrategy.HYBRID_OPT


def check_dtype(name: str, value: object, optional: bool) -> Optional[torch.dtype]:
    """``value`` if it is a floating ``torch.dtype`` (or ``None`` when ``optional``).

    Raises:
        TypeError: anything else (the message names it).
    """
    if value is None and optional:
        return None
    value = dtype_named(value)  # "float32" / "torch.float32" from a config file
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        expected = "a floating torch.dtype" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    return value
