"""An update to give back when the loss after it is not finite.

With ``adaptive_damping`` the Levenberg–Marquardt rule evaluates the loss after the update. When
that loss is not finite the update has carried the parameters where the model diverges: keeping
it would leave every later batch non-finite (each step skipped, the damping's rise never used)
and, under ``on_nonfinite="raise"``, the error would come one step late with the parameters
already spoilt. :class:`UpdateUndo`, saved on the LM rule's steps before the update, puts back
the parameters, their optimizer state (momentum buffers, adaptive mode's last update), adaptive
mode's last coefficients and what the closure changed (:class:`~torchsso2.optim.skips.StepUndo`):
the step is then skipped like a step whose update is not finite, and like it keeps the batch's
(finite) curvature.

Its cost, on the LM rule's steps only: one copy of the parameters (the fixed mode's rule needs it
anyway, for the update ``θ − old``) and, in the fixed mode, of the momentum buffers (written in
place by the update; adaptive mode replaces its state tensors, so references are kept).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn

from .skips import StepUndo

__all__ = ["UpdateUndo"]


def _saved(value: Any, in_place: bool) -> Any:
    """What :class:`UpdateUndo` keeps of a state entry: a clone of a tensor the update writes in place, the
    tensor itself where the update replaces it (``copy.copy`` of a tensor pickles it: ~30 µs), a shallow copy
    of anything else."""
    if isinstance(value, Tensor):
        return value.clone() if in_place else value
    return copy.copy(value)


class UpdateUndo:
    """The state an update of ``params`` by optimizer ``opt`` changes, saved before it.

    ``values``: the parameters' values (``[P_i]`` clones, in ``params`` order; the LM rule also
    takes the update as ``θ − values``); ``snapshot``: the closure's random streams and normalisation
    statistics."""

    def __init__(self, opt: Any, params: List[nn.Parameter], snapshot: StepUndo) -> None:
        self.params = params
        with torch.no_grad():
            self.values: List[Tensor] = [p.detach().clone() for p in params]
        in_place = opt.adaptive is None  # the fused momentum writes its buffers in place
        self.states: List[Optional[Dict[str, Any]]] = [
            {k: _saved(v, in_place) for k, v in opt.state[p].items()} if p in opt.state else None for p in params]
        self.adaptive_last = dict(opt.adaptive.last) if opt.adaptive is not None else None
        self.snapshot = snapshot

    def restore(self, opt: Any) -> None:
        """Put everything saved back into ``opt`` (its parameters are written in place)."""
        with torch.no_grad():
            for p, v in zip(self.params, self.values):
                p.copy_(v)
        for p, s in zip(self.params, self.states):
            if s is None:
                opt.state.pop(p, None)
            else:
                opt.state[p] = s
        if self.adaptive_last is not None:
            opt.adaptive.last = self.adaptive_last
        self.snapshot.restore()
