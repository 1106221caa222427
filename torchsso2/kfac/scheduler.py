"""``LambdaParamScheduler``: multiplicative schedules of a preconditioner's hyper-parameters.

kfac_pytorch's ``kfac.scheduler.LambdaParamScheduler``, same semantics::

    preconditioner = KFACPreconditioner(model, damping=0.003, inv_update_steps=10)
    scheduler = LambdaParamScheduler(preconditioner, damping_lambda=lambda step: 0.5 if step in (30, 60) else 1.0)
    for ...:
        ...; preconditioner.step(); optimizer.step(); scheduler.step()

Each ``<name>_lambda(step)`` returns a *factor*: :meth:`LambdaParamScheduler.step` sets
``value ← value · factor(step)`` (``int(value · factor)`` for ``factor_update_steps`` and
``inv_update_steps``), with ``step`` = ``preconditioner.steps`` unless given.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Dict, Optional

from .base_preconditioner import HYPERPARAMS, BaseKFACPreconditioner
from .hyperparams import as_number, check_value

__all__ = ["LambdaParamScheduler", "NotAPreconditionerError"]


class NotAPreconditionerError(TypeError, AttributeError):
    """The object given as the preconditioner is not a K-FAC preconditioner (a ``TypeError``, and an
    ``AttributeError`` as kfac_pytorch's scheduler raises for it)."""

_INTEGER = ("factor_update_steps", "inv_update_steps")


class LambdaParamScheduler:
    """Multiply a preconditioner's hyper-parameters by ``lambda(step)`` at every :meth:`step`.

    Args:
        preconditioner: a :class:`BaseKFACPreconditioner` (e.g. ``KFACPreconditioner``).
        factor_update_steps_lambda, inv_update_steps_lambda, damping_lambda,
        factor_decay_lambda, kl_clip_lambda, lr_lambda: ``step -> factor`` (``None``: leave
            that hyper-parameter alone).

    Raises:
        ValueError: a lambda is given for a hyper-parameter that the preconditioner already
            holds as a callable (the two cannot be combined).
        AttributeError: ``preconditioner`` lacks the hyper-parameter of a given lambda (not a
            :class:`BaseKFACPreconditioner`; kfac_pytorch raises the same class).
        TypeError: a lambda is not callable.
    """

    def __init__(
        self,
        preconditioner: BaseKFACPreconditioner,
        *,
        factor_update_steps_lambda: Optional[Callable[[int], float]] = None,
        inv_update_steps_lambda: Optional[Callable[[int], float]] = None,
        damping_lambda: Optional[Callable[[int], float]] = None,
        factor_decay_lambda: Optional[Callable[[int], float]] = None,
        kl_clip_lambda: Optional[Callable[[int], float]] = None,
        lr_lambda: Optional[Callable[[int], float]] = None,
    ) -> None:
        self._preconditioner = preconditioner
        given = dict(zip(HYPERPARAMS, (factor_update_steps_lambda, inv_update_steps_lambda, damping_lambda,
                                       factor_decay_lambda, kl_clip_lambda, lr_lambda)))
        self._lambdas: Dict[str, Callable[[int], float]] = {}
        for name, fn in given.items():
            setattr(self, f"_{name}_lambda", fn)  # kfac_pytorch's attribute names
            if fn is None:
                continue
            if not callable(fn):
                raise TypeError(f"{name}_lambda must be a callable of the step or None, got {type(fn).__name__}")
            if not hasattr(preconditioner, f"_{name}"):
                raise NotAPreconditionerError(f"{type(preconditioner).__name__} has no _{name}: the preconditioner "
                                              "must be a BaseKFACPreconditioner (e.g. KFACPreconditioner)")
            if callable(getattr(preconditioner, f"_{name}")):
                raise ValueError(f"preconditioner.{name} is already a callable and cannot be updated by the "
                                 f"LambdaParamScheduler (pass a number as {name}, or leave {name}_lambda out)")
            self._lambdas[name] = fn

    def step(self, step: Optional[int] = None) -> None:
        """Multiply each scheduled hyper-parameter by its factor; call after ``preconditioner.step()``.

        Args:
            step: the step passed to the lambdas (default: ``preconditioner.steps``).
        """
        pre = self._preconditioner
        at = pre.steps if step is None else step
        values = {}  # every new value computed and checked first, then all set: a refused one sets none
        for name, fn in self._lambdas.items():
            current = getattr(pre, f"_{name}")
            if callable(current):
                raise ValueError(f"preconditioner.{name} became a callable; the scheduler cannot update it")
            value = as_number(current * as_number(fn(at)))
            if name in _INTEGER and isinstance(value, numbers.Real) and math.isfinite(value):
                value = int(value)
            try:  # the checks a callable's value gets (kfac_pytorch checks none)
                check_value(name, value, from_callable=True)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{exc} (set by LambdaParamScheduler at step {at}; no hyper-parameter was "
                                "changed)") from None
            values[name] = value
        for name, value in values.items():
            setattr(pre, f"_{name}", value)
