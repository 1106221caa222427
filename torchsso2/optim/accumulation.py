"""Gradient accumulation inside one closure: the targets of each micro-batch.

A closure may run several forwards (micro-batches, each followed by its own ``backward``); the
optimizer estimates the curvature of each and averages them weighted by batch size. Kinds that
need the targets (``empirical_fisher`` with ``targets=``, ``hessian``) take them from ``step(closure,
targets=y)``: ``y`` holds the targets of all micro-batches, concatenated in the order the
closure runs them, and :class:`MicroBatchTargets` hands each forward its rows.

``empirical_fisher`` *without* targets takes the per-example gradients from the closure's own
``backward`` and supports one forward per closure; :data:`ACCUMULATION_NEEDS_TARGETS` is the one
message for that limitation and its fix.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

#: the limitation of ``empirical_fisher`` without targets, and the fix
ACCUMULATION_NEEDS_TARGETS = (
    "curvature='empirical_fisher' without targets reads the per-example gradients from the closure's own "
    "backward, which supports one forward per closure; for gradient accumulation (several forwards in one "
    "closure) call step(closure, targets=y) with y the targets of all micro-batches, concatenated in the "
    "order the closure runs them. A forward whose output the loss does not use (pseudo-labels, a metric, a "
    "detached target network's output) belongs under torch.no_grad(). If the loss combines several forwards "
    "(siamese, triplet, two views), targets do not apply: run one forward on the concatenated inputs, or use "
    "a Fisher kind or VIOptimizer's default diagonal")


class MicroBatchTargets:
    """Hands the k-th forward of a closure its rows of ``targets`` (all micro-batches' targets,
    concatenated; ``[N_total, ...]``). With one forward the targets are passed through whole."""

    def __init__(self, targets: Optional[Tensor]) -> None:
        self.targets = targets
        self.offset = 0
        self.forwards = 0

    def next(self, n: int) -> Optional[Tensor]:
        """The targets of the next forward, whose output has ``n`` rows (None without targets)."""
        t = self.targets
        self.forwards += 1
        if t is None or not isinstance(t, Tensor) or t.dim() == 0:
            return t
        if self.forwards == 1 and t.shape[0] == n:  # one forward (the common case): no slicing
            self.offset = n
            return t
        if self.offset + n > t.shape[0]:
            raise ValueError(
                f"targets has {t.shape[0]} rows, but the closure's forwards so far have {self.offset + n} examples "
                f"(forward {self.forwards} has {n}); for gradient accumulation pass the targets of all "
                "micro-batches, concatenated in the order the closure runs them, to step(closure, targets=...); "
                "run a forward whose output the loss does not use (pseudo-labels, a metric) under torch.no_grad()")
        rows = t.narrow(0, self.offset, n)
        self.offset += n
        return rows

    def finish(self) -> None:
        """After the closure: every row of the targets belonged to some forward."""
        t = self.targets
        if isinstance(t, Tensor) and t.dim() > 0 and self.forwards and self.offset != t.shape[0]:
            raise ValueError(
                f"targets has {t.shape[0]} rows, but the closure's {self.forwards} forward(s) had {self.offset} "
                "examples; pass the targets of exactly the examples the closure runs (for gradient accumulation: "
                "all micro-batches' targets, concatenated in order)")


def is_second_forward_reuse(err: ValueError, forwards: int) -> bool:
    """The capture's "called more than once" error raised during a second forward of the closure
    (not a layer shared inside one forward, which raises during the first)."""
    return forwards >= 1 and "called more than once" in str(err)


#: why ``curvature="hessian"`` needs ``step(closure, targets=y)``, and how to give them
HESSIAN_NEEDS_TARGETS = (
    "curvature='hessian' needs the targets: the Hessian is taken of the mean loss recomputed from the model "
    "output and the targets by double backward, and the closure's own loss cannot serve (its backward has "
    "already freed the graph). Call opt.step(closure, targets=y) with y the targets of the batch the closure "
    "runs (for gradient accumulation: all micro-batches' targets, concatenated in order)")
