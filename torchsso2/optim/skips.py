"""What makes a skipped step a no-op, and when a run of skipped steps becomes an error.

A step skipped by the non-finite policy (``on_nonfinite="skip"``) must leave everything as if
the batch had never been seen, except the skip counter: the step count (and with it the
curvature / decomposition schedule and VI's weight noise, seeded by the step), the sampling
generator (labels drawn for ``fisher_mc`` inside the closure) and the running statistics of
normalisation layers (a NaN batch in train mode writes NaN into ``BatchNorm.running_mean``).
:class:`StepUndo` records the sampling generator and those buffers before the closure runs and
puts them back when the step is skipped.

:class:`SkipStreak` counts consecutive skipped steps; after ``max_consecutive_skips`` of them
training has stalled (the model produces non-finite values at every step) and the step raises
:class:`NonFiniteError` with what diverged and what to try, instead of running on silently.
"""
from __future__ import annotations

import numbers

import math
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

#: default bound on consecutive skipped steps before :class:`NonFiniteError` is raised
DEFAULT_MAX_CONSECUTIVE_SKIPS = 20


class NonFiniteError(FloatingPointError):
    """Raised under ``on_nonfinite="raise"`` when a gradient, a curvature statistic or a decomposition
    is not finite, and under ``"skip"`` after ``max_consecutive_skips`` consecutive skipped steps."""


def check_max_consecutive_skips(value: Optional[int]) -> Optional[int]:
    """``None`` (never raise) or an int >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"max_consecutive_skips must be an int >= 1 or None, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"max_consecutive_skips={value!r} is invalid: max_consecutive_skips must be an int >= 1 "
                         "or None (never raise)")
    return int(value)


def norm_layers(model: nn.Module) -> List[_NormBase]:
    """The BatchNorm / InstanceNorm layers of ``model`` that track running statistics."""
    return [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats]


class StepUndo:
    """What a step may change before it knows whether it will be skipped, saved before the closure
    runs and given back by :meth:`restore` when it is skipped.

    * the sampling generator's state (``fisher_mc`` labels are drawn inside the closure);
    * ``running_mean``, ``running_var`` and ``num_batches_tracked`` of the norm layers in training
      mode (a forward in train mode writes them; the layers are found once, at construction).
      The copies are kept between steps and refreshed in place (one ``torch._foreach_copy_``),
      so a step with BatchNorm costs one copy of a few vectors per layer.
    """

    def __init__(self, model: nn.Module) -> None:
        self.norms = norm_layers(model)
        self._generator: Optional[torch.Generator] = None
        self._generator_state: Optional[Tensor] = None
        self._live: List[Tensor] = []
        self._saved: List[Tensor] = []

    def save(self, generator: Optional[torch.Generator]) -> "StepUndo":
        self._generator = generator
        self._generator_state = generator.get_state() if generator is not None else None
        if not self.norms:
            return self
        # the layers' buffers (running_mean, running_var, num_batches_tracked) straight from their
        # dicts: nn.Module.__getattr__ would cost ~2 µs a name
        live = [b for m in self.norms if m.training for b in m._buffers.values() if b is not None]
        if len(live) != len(self._live) or any(a is not b for a, b in zip(live, self._live)):
            self._live, self._saved = live, [b.clone() for b in live]  # new layers or buffers (model.to)
        elif live:
            with torch.no_grad():
                torch._foreach_copy_(self._saved, live)
        return self

    def restore(self) -> None:
        if self._generator is not None and self._generator_state is not None:
            self._generator.set_state(self._generator_state)
        if self._live:
            with torch.no_grad():
                torch._foreach_copy_(self._live, self._saved)


def diagnose(loss: object, grads: Dict[str, Optional[Tensor]], statistics: Dict[str, Sequence[Tensor]]) -> str:
    """Which of the loss, the gradients (by parameter name) and the fresh curvature statistics (by
    module name) are not finite, as one phrase (for the stall error; computed only then)."""
    parts = []
    if isinstance(loss, Tensor):
        if not bool(torch.isfinite(loss.detach()).all()):
            parts.append(f"the loss ({float(loss.detach().double().mean())})")
    elif isinstance(loss, (int, float)) and not math.isfinite(float(loss)):
        parts.append(f"the loss ({loss})")
    bad = [n for n, g in grads.items() if g is not None and not bool(torch.isfinite(g).all())]
    if bad:
        parts.append("the gradients of " + ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
    bad = [n for n, ts in statistics.items() if any(not bool(torch.isfinite(t).all()) for t in ts)]
    if bad:
        parts.append("the curvature statistics of " + ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
    return "; ".join(parts)


class SkipStreak:
    """Consecutive skipped steps; :meth:`skipped` raises :class:`NonFiniteError` when the bound is hit."""

    __slots__ = ("limit", "count")

    def __init__(self, limit: Optional[int]) -> None:
        self.limit = check_max_consecutive_skips(limit)
        self.count = 0

    def taken(self) -> None:
        """A step was taken: the streak ends."""
        self.count = 0

    def skipped(self, step: int, what: str, details: str = "", reason: Optional[str] = None) -> int:
        """One more skipped step (``step``: the step index, ``what``: what was non-finite, ``details``:
        which tensors; ``reason``: why the step failed where nothing was non-finite); returns the length of the
        streak."""
        self.count += 1
        if self.limit is not None and self.count >= self.limit:
            # a failed decomposition, or a failure with a reason (adaptive mode's model without minimum), comes after
            # the running curvature took the step's estimate; a non-finite batch is given back whole
            decomposition = "decomposition" in what
            state = ("The parameters are as before the first skipped step; the running curvature has taken the "
                     "estimates of the skipped steps that made one (and adaptive_damping, where on, raised the "
                     "damping)." if decomposition or reason is not None
                     else "The optimizer state is as before the first skipped step.")
            if reason is not None:
                raise NonFiniteError(
                    f"training has stalled: {self.count} consecutive steps were skipped at step {step}: {reason}. "
                    f"max_consecutive_skips (None: never raise) sets how many skips in a row are tolerated. {state}")
            found = f" (this step: {details})" if details else ""
            cause = ("The damped curvature is singular (damping=0 with a rank-deficient estimate, e.g. fewer examples "
                     "than a Kronecker factor's size), indefinite (curvature='hessian' at a damping below its most "
                     "negative eigenvalue) or not finite (the model diverged or the data holds NaN/inf)"
                     if decomposition else "The model diverged or the data holds NaN/inf")
            raise NonFiniteError(
                f"training has stalled: {self.count} consecutive steps were skipped at step {step} because of a "
                f"non-finite {what}{found}. {cause}. Try a lower lr, more "
                "damping (for VIOptimizer also a larger prior_precision or init_precision), "
                "decomposition_dtype=torch.float64, or restore a checkpoint and check the data; "
                f"max_consecutive_skips (None: never raise) sets how many skips in a row are tolerated. {state}")
        return self.count
