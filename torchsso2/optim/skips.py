"""What makes a skipped step a no-op, and when a run of skipped steps becomes an error.

A step skipped by the non-finite policy (``on_nonfinite="skip"``) must leave everything as if
the batch had never been seen, except the skip counter: the step count (and with it the
curvature / decomposition schedule and VI's weight noise, seeded by the step), the sampling
generator (labels drawn for ``fisher_mc`` inside the closure) and the running statistics of
normalisation layers (a NaN batch in train mode writes NaN into ``BatchNorm.running_mean``).
:class:`StepSnapshot` records the random streams and those buffers before the closure runs and
puts them back when the step is skipped.

:class:`SkipStreak` counts consecutive skipped steps; after ``max_consecutive_skips`` of them
training has stalled (the model produces non-finite values at every step) and the step raises
:class:`NonFiniteError` with what diverged and what to try, instead of running on silently.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

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
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_consecutive_skips must be an int >= 1 or None, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"max_consecutive_skips={value!r} is invalid; expected an int >= 1 or None (never raise)")
    return value


def running_stat_buffers(model: nn.Module) -> List[Tensor]:
    """The running statistics a forward in train mode writes: ``running_mean``, ``running_var`` and
    ``num_batches_tracked`` of every BatchNorm / InstanceNorm layer that tracks them."""
    out: List[Tensor] = []
    for mod in model.modules():
        if isinstance(mod, _NormBase) and mod.track_running_stats:
            out.extend(b for b in (mod.running_mean, mod.running_var, mod.num_batches_tracked) if b is not None)
    return out


class StepSnapshot:
    """The random streams and normalisation statistics before a step (restored if it is skipped).

    ``generators``: the optimizer's sampling generator (and any other generator the step draws
    from); ``model``: whose BatchNorm/InstanceNorm running statistics are saved (a few vectors
    per norm layer: cheap next to a forward)."""

    __slots__ = ("_generators", "_buffers")

    def __init__(self, generators: Sequence[torch.Generator], model: nn.Module) -> None:
        self._generators: List[Tuple[torch.Generator, Tensor]] = [(g, g.get_state()) for g in generators]
        self._buffers: List[Tuple[Tensor, Tensor]] = [(b, b.clone()) for b in running_stat_buffers(model)]

    def restore(self) -> None:
        for gen, state in self._generators:
            gen.set_state(state)
        with torch.no_grad():
            for buf, saved in self._buffers:
                buf.copy_(saved)


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

    def skipped(self, step: int, what: str, details: str = "") -> int:
        """One more skipped step (``step``: the step index, ``what``: what was non-finite, ``details``:
        which tensors); returns the length of the streak."""
        self.count += 1
        if self.limit is not None and self.count >= self.limit:
            found = f" (this step: {details})" if details else ""
            raise NonFiniteError(
                f"training has stalled: {self.count} consecutive steps were skipped at step {step} because of a "
                f"non-finite {what}{found}. The model diverged or the data holds NaN/inf. Try a lower lr, more "
                "damping (for VIOptimizer also a larger prior_precision or init_precision), "
                "decomposition_dtype=torch.float64, or restore a checkpoint and check the data; "
                "max_consecutive_skips (None: never raise) sets how many skips in a row are tolerated. "
                "The optimizer state is as before the first skipped step.")
        return self.count
