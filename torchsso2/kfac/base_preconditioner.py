"""``BaseKFACPreconditioner``: the layer-independent part of a K-FAC preconditioner.

kfac_pytorch's ``kfac.base_preconditioner.BaseKFACPreconditioner`` interface: the
hyper-parameters (numbers or callables of the K-FAC step), their validation, the step
counter, ``state_dict`` / ``load_state_dict`` of the hyper-parameters and factors,
``memory_usage``, ``reset_batch`` and the ``repr``. A subclass supplies the layers, the work
assignment, the communicator and :meth:`step` (and :meth:`_recompute_inverses` for
``load_state_dict(compute_inverses=True)``); :class:`torchsso2.kfac.KFACPreconditioner` is one.

The layers are given as kfac_pytorch gives them: ``{module: (name, layer)}``, where a layer
object has ``state_dict()``, ``load_state_dict(state)``, ``memory_usage() -> {key: bytes}``
and ``reset_batch()`` (:class:`torchsso2.kfac.layer.KFACLayer` has them).
"""
from __future__ import annotations

import logging
import numbers
import warnings
from collections import defaultdict
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np
from torch import nn

from .hyperparams import ClipSchedule, Schedule, as_number, check_schedule, evaluate

__all__ = ["BaseKFACPreconditioner"]

HYPERPARAMS = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr")


class BaseKFACPreconditioner:
    """Hyper-parameters, step counter, state and bookkeeping of a K-FAC preconditioner.

    Args (kfac_pytorch's names and defaults):
        layers: ``{module: (name, layer)}`` of the registered layers.
        assignment: the work assignment of the layers (kept as ``_assignment``).
        tdc: the communicator (kept as ``_tdc``).
        factor_update_steps: steps between factor updates, int ``> 0`` or callable of the step.
        inv_update_steps: steps between decompositions, int ``> 0`` or callable of the step.
        damping: Tikhonov damping, ``> 0`` (or callable).
        factor_decay: running-average weight of the factors, in ``(0, 1]`` (a callable may
            also return ``0``).
        kl_clip: KL-clip parameter, ``> 0`` (or a callable; returning ``None``: no clipping).
        lr: learning rate used by the KL clip, ``>= 0`` (or callable).
        accumulation_steps: forward/backward passes per optimization step, int ``> 0``.
        update_factors_in_hook: fold the factor batches into the running factors in the
            hooks (``True``) or at the start of :meth:`step`.
        defaults: extra ``name -> value`` shown by ``repr`` (bookkeeping only).
        loglevel: level of the preconditioner's log messages.

    Raises:
        ValueError / TypeError: a bad hyper-parameter (the message names it and what was
            expected). A warning when ``inv_update_steps`` is not a multiple of
            ``factor_update_steps``.
    """

    def __init__(
        self,
        layers: Mapping[nn.Module, Tuple[str, Any]],
        *,
        assignment: Any,
        tdc: Any,
        factor_update_steps: Schedule = 1,
        inv_update_steps: Schedule = 1,
        damping: Schedule = 0.001,
        factor_decay: Schedule = 0.95,
        kl_clip: ClipSchedule = 0.001,
        lr: Schedule = 0.1,
        accumulation_steps: int = 1,
        update_factors_in_hook: bool = True,
        defaults: Optional[Dict[str, Any]] = None,
        loglevel: int = logging.DEBUG,
    ) -> None:
        self._init_hyperparams(
            factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps, damping=damping,
            factor_decay=factor_decay, kl_clip=kl_clip, lr=lr, accumulation_steps=accumulation_steps,
            update_factors_in_hook=update_factors_in_hook, loglevel=loglevel, stacklevel=3,
        )
        self._init_layers(layers, assignment, tdc, defaults)

    # ---- the two parts of the initialization (a subclass may run them at different times) ----
    def _init_hyperparams(
        self,
        *,
        factor_update_steps: Schedule,
        inv_update_steps: Schedule,
        damping: Schedule,
        factor_decay: Schedule,
        kl_clip: ClipSchedule,
        lr: Schedule,
        accumulation_steps: int,
        update_factors_in_hook: bool,
        loglevel: int,
        stacklevel: int = 3,
    ) -> None:
        """Check and store the hyper-parameters; set the step counters to 0."""
        factor_update_steps, inv_update_steps, damping, factor_decay, kl_clip, lr = (
            as_number(v) for v in (factor_update_steps, inv_update_steps, damping, factor_decay, kl_clip, lr))
        for name, value in (("factor_update_steps", factor_update_steps), ("inv_update_steps", inv_update_steps),
                            ("damping", damping), ("factor_decay", factor_decay), ("kl_clip", kl_clip), ("lr", lr)):
            check_schedule(name, value)
        accumulation_steps = as_number(accumulation_steps)
        if isinstance(accumulation_steps, float) and accumulation_steps.is_integer():  # 2.0, as factor_update_steps
            accumulation_steps = int(accumulation_steps)
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, numbers.Integral):
            raise TypeError(f"accumulation_steps must be an int > 0, got {accumulation_steps!r}")
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an int > 0, got {accumulation_steps!r}")
        _check_loglevel(loglevel)
        if (not callable(factor_update_steps) and not callable(inv_update_steps)
                and inv_update_steps % factor_update_steps != 0):
            warnings.warn("It is suggested that inv_update_steps be an integer multiple of factor_update_steps "
                          f"(got {inv_update_steps} and {factor_update_steps})", stacklevel=stacklevel)
        self._factor_update_steps = factor_update_steps
        self._inv_update_steps = inv_update_steps
        self._damping = damping
        self._factor_decay = factor_decay
        self._kl_clip = kl_clip
        self._lr = lr
        self._accumulation_steps = int(accumulation_steps)
        self._update_factors_in_hook = parse_flag("update_factors_in_hook", update_factors_in_hook)
        self._loglevel = int(loglevel)
        self._steps = 0
        self._mini_steps: Dict[str, int] = defaultdict(int)

    def _init_layers(self, layers: Mapping[nn.Module, Tuple[str, Any]], assignment: Any, tdc: Any,
                     defaults: Optional[Dict[str, Any]]) -> None:
        """Store the layers (``{module: (name, layer)}``), the assignment, the communicator."""
        if not isinstance(layers, Mapping):
            raise TypeError(f"layers must be a dict {{module: (name, layer)}}, got {type(layers).__name__}")
        self._layers: Dict[nn.Module, Tuple[str, Any]] = dict(layers)
        self._assignment = assignment
        self._tdc = tdc
        self._defaults = defaults

    # ---- hyper-parameters at the current step --------------------------------------------------
    @property
    def steps(self) -> int:
        """Number of :meth:`step` calls so far (the argument of the hyper-parameter callables)."""
        return self._steps

    @property
    def factor_update_steps(self) -> int:
        """Steps between factor updates, at the current step."""
        return evaluate("factor_update_steps", self._factor_update_steps, self._steps)  # type: ignore[return-value]

    @property
    def inv_update_steps(self) -> int:
        """Steps between decompositions, at the current step."""
        return evaluate("inv_update_steps", self._inv_update_steps, self._steps)  # type: ignore[return-value]

    @property
    def damping(self) -> float:
        """Damping at the current step."""
        return evaluate("damping", self._damping, self._steps)

    @property
    def factor_decay(self) -> float:
        """Running-average weight of the factors at the current step."""
        return evaluate("factor_decay", self._factor_decay, self._steps)

    @property
    def kl_clip(self) -> Optional[float]:
        """KL-clip parameter at the current step (``None``: no clipping)."""
        return evaluate("kl_clip", self._kl_clip, self._steps)  # type: ignore[arg-type]

    @property
    def lr(self) -> float:
        """Learning rate used by the KL clip at the current step."""
        return evaluate("lr", self._lr, self._steps)

    @property
    def accumulation_steps(self) -> int:
        """Forward/backward passes per optimization step."""
        return self._accumulation_steps

    @property
    def update_factors_in_hook(self) -> bool:
        """Whether the factors are folded into the running averages in the hooks."""
        return self._update_factors_in_hook

    @update_factors_in_hook.setter
    def update_factors_in_hook(self, value: bool) -> None:
        self._update_factors_in_hook = parse_flag("update_factors_in_hook", value)

    @property
    def loglevel(self) -> int:
        """Level of the preconditioner's log messages."""
        return self._loglevel

    @loglevel.setter
    def loglevel(self, value: int) -> None:
        _check_loglevel(value)
        self._loglevel = int(value)

    # ---- the step (subclasses) ---------------------------------------------------------------------
    def step(self) -> None:
        """Precondition the gradients of the registered layers; implemented by subclasses."""
        raise NotImplementedError(f"{type(self).__name__} must implement step() "
                                  "(BaseKFACPreconditioner holds only the layer-independent part)")

    def _recompute_inverses(self) -> None:
        """Recompute the decompositions from the current factors (``load_state_dict``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _recompute_inverses() to load a "
                                  "state_dict with compute_inverses=True")

    # ---- state ---------------------------------------------------------------------------------------
    def state_dict(self, include_factors: bool = True) -> Dict[str, Any]:
        """``{"steps", the non-callable hyper-parameters, "layers": {name: layer.state_dict()}}``.

        ``layers`` only with ``include_factors``.
        """
        state: Dict[str, Any] = {"steps": self._steps}
        for name in HYPERPARAMS:
            value = getattr(self, f"_{name}")
            if not callable(value):
                state[name] = value
        if include_factors:
            state["layers"] = {name: layer.state_dict() for name, layer in self._layers.values()}
        return state

    def load_state_dict(self, state_dict: Dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict`; with ``compute_inverses`` recompute the decompositions.

        Raises:
            ValueError: not a state dict of this preconditioner, or another number of layers.
        """
        if not isinstance(state_dict, Mapping) or "steps" not in state_dict:
            raise ValueError("state_dict must be a dict from state_dict() (with a 'steps' key)")
        if "layers" in state_dict and len(state_dict["layers"]) != len(self._layers):
            raise ValueError(f"loaded state dict contains a different number of layers: "
                             f"{len(state_dict['layers'])} saved, {len(self._layers)} registered")
        self._steps = int(state_dict["steps"])
        for name in HYPERPARAMS:
            if name in state_dict:
                setattr(self, f"_{name}", state_dict[name])
        if "layers" in state_dict:
            by_name = {name: layer for name, layer in self._layers.values()}
            for name, layer_state in state_dict["layers"].items():
                if name in by_name:
                    by_name[name].load_state_dict(layer_state)
        elif compute_inverses:
            warnings.warn("Layer factors are not included in the state_dict so inverses cannot be computed; "
                          "skipping inverse computation", stacklevel=2)
            compute_inverses = False
        if compute_inverses:
            self._recompute_inverses()

    def reset_batch(self) -> None:
        """Drop the factor batches collected since the last update."""
        for _, layer in self._layers.values():
            layer.reset_batch()

    def memory_usage(self) -> Dict[str, int]:
        """Bytes of K-FAC state on this rank, per kind (the layers' keys) and ``total``."""
        sizes: Dict[str, int] = defaultdict(int)
        for _, layer in self._layers.values():
            for key, n in layer.memory_usage().items():
                sizes[key] += n
        sizes["total"] = sum(sizes.values())
        return dict(sizes)

    def __repr__(self) -> str:
        params = {
            "accumulation_steps": self._accumulation_steps,
            "assignment": type(self._assignment).__name__,
            "damping": self._damping, "factor_decay": self._factor_decay,
            "factor_update_steps": self._factor_update_steps, "inv_update_steps": self._inv_update_steps,
            "kl_clip": self._kl_clip, "layers": len(self._layers), "loglevel": self._loglevel, "lr": self._lr,
            "steps": self._steps, "update_factors_in_hook": self._update_factors_in_hook,
        }
        params.update(self._defaults or {})
        body = "\n".join(f"  {k}={v}," for k, v in sorted(params.items()))
        return f"{type(self).__name__}(\n{body}\n)"


def parse_flag(name: str, value: object) -> bool:
    """A bool argument: ``True``/``False`` or the ints ``1``/``0`` (kfac_pytorch takes both).

    Raises:
        TypeError: anything else (a string or a float would be truthy garbage).
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool (or 0/1), got {type(value).__name__} {value!r}")


def _check_loglevel(value: object) -> None:
    """A logging level: an int >= 0 (bool refused), as ``logging.DEBUG``; TypeError/ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"loglevel must be an int logging level (e.g. logging.DEBUG), got {value!r}")
    if value < 0:
        raise ValueError(f"loglevel={value!r} must be a logging level >= 0 (e.g. logging.DEBUG = 10)")
