"""``KFACPreconditioner``'s non-finite policy (``on_nonfinite``, ``max_consecutive_skips``).

:meth:`KFACPreconditioner.step` checks, after this step's factor batches are folded into the
running factors and all-reduced and before any decomposition is computed:

* the ``.grad`` of every parameter of the registered layers (not with a ``grad_scaler``: AMP
  overflows keep kfac_pytorch's handling, the scaler skips ``optimizer.step()`` itself);
* the running factors updated in this step (in the backward hooks or at the start of ``step``);

and, after the decompositions and the preconditioned gradients are computed (and broadcast)
and before ``.grad`` is written:

* the preconditioned gradients (non-finite only through a failed or non-finite
  decomposition: a ``LinalgError`` of the backend becomes NaN decompositions on the rank that
  computed them, so that the ranks waiting for their broadcast do not hang).

A non-finite value makes the step a no-op for the preconditioner: the running factors are put
back to the tensors they were before this step's fold (the fold makes new tensors, so the old
ones are kept by reference, not copied), so are the decompositions if this step recomputed
them, the pending factor batches are dropped, and ``steps`` and the gradients are left exactly
as they were. Under ``"skip"`` a
warning is logged and ``num_skipped`` counts it; after ``max_consecutive_skips`` skips in a row
:class:`~torchsso2.NonFiniteError` says the run diverged. Under ``"raise"`` the state is put
back the same way and :class:`~torchsso2.NonFiniteError` is raised at once.

With several ranks every rank reaches the same verdict without a collective of its own: the
gradients are averaged over ranks before ``step`` (DDP; the preconditioner's contract) and the
factors are checked after their all-reduce, so a NaN on one rank is a NaN on every rank.
"""
from __future__ import annotations

import logging
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from curvature.linalg.checks import all_finite
from curvature.options import did_you_mean
from torchsso2.optim import NonFiniteError
from torchsso2.optim.skips import check_max_consecutive_skips  # one rule for all three faces

from .layer import KFACLayer

logger = logging.getLogger(__name__)

__all__ = ["NonFiniteError", "SkipPolicy", "check_max_consecutive_skips", "check_on_nonfinite",
           "decompositions_before", "nonfinite_entries", "nonfinite_results", "restore_decompositions"]

ON_NONFINITE = ("skip", "raise")


def check_on_nonfinite(value: object) -> str:
    """``"skip"`` or ``"raise"``."""
    if not isinstance(value, str):
        raise TypeError(f"on_nonfinite must be 'skip' or 'raise', got {type(value).__name__} {value!r}")
    if value.strip().lower() not in ON_NONFINITE:  # any case, as the optimizers take it
        raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {value!r}{did_you_mean(value, list(ON_NONFINITE))}")
    return value.strip().lower()


def nonfinite_entries(layers: Sequence[KFACLayer], updated: Iterable[str], check_grads: bool) -> List[str]:
    """Labels (``"fc1.weight.grad"``, ``"fc1 factor A"``) of the non-finite tensors of a step.

    Args:
        layers: the registered layers.
        updated: names of the layers whose running factors were updated in this step.
        check_grads: include the parameters' ``.grad``.

    One host sync when everything is finite (:func:`curvature.linalg.checks.all_finite`).
    """
    updated = set(updated)
    items: List[Tuple[str, Tensor]] = []
    for layer in layers:
        if check_grads:
            for name, p in zip(layer.param_names, layer.params):
                if p.grad is not None:
                    items.append((f"{layer.name}.{name}.grad", p.grad))
        if layer.name in updated and layer.has_factors():
            items.append((f"{layer.name} factor A", layer.a_factor))  # type: ignore[arg-type]
            items.append((f"{layer.name} factor G", layer.g_factor))  # type: ignore[arg-type]
    if all_finite([t for _, t in items]):
        return []
    return [label for label, t in items if t.numel() and not bool(torch.isfinite(t).all())]


def nonfinite_results(results: Sequence[Tuple[KFACLayer, Tensor, Tensor]]) -> List[str]:
    """Labels of the non-finite preconditioned gradients ``(layer, precond, grad)`` of a step
    (after their broadcast: every rank holds the same ones, so every rank finds the same), with
    the decomposition failure this rank saw, if any. Finite gradients and factors give a
    non-finite result only through the decompositions (a failed or non-finite ``eigh``/inverse)."""
    if all_finite([p for _, p, _ in results]):
        return []
    out = []
    for layer, precond, _ in results:
        if precond.numel() and not bool(torch.isfinite(precond).all()):
            why = layer.decomposition_error or "non-finite decompositions"
            hint = "more damping" if layer.inv_dtype == torch.float64 else "inv_dtype=torch.float64 or more damping"
            out.append(f"{layer.name} preconditioned gradient ({why}; try {hint})")
    return out


def decompositions_before(layers: Sequence[KFACLayer]) -> Dict[str, Tuple[Dict[str, Tensor], bool]]:
    """The layers' decompositions before an inverse step (the dicts copied, not the tensors: the
    step makes new tensors) and clears their ``decomposition_error``."""
    saved = {}
    for layer in layers:
        saved[layer.name] = (dict(layer.inv), layer.inv_ready)
        layer.decomposition_error = None
    return saved


def restore_decompositions(layers: Sequence[KFACLayer], saved: Dict[str, Tuple[Dict[str, Tensor], bool]]) -> None:
    """Put back what :func:`decompositions_before` saved."""
    for layer in layers:
        layer.inv, layer.inv_ready = dict(saved[layer.name][0]), saved[layer.name][1]


class SkipPolicy:
    """Counts skipped steps and applies ``on_nonfinite`` / ``max_consecutive_skips``.

    Args:
        on_nonfinite: ``"skip"`` or ``"raise"``.
        max_consecutive_skips: skips in a row tolerated under ``"skip"`` (``None``: no limit).
    """

    def __init__(self, on_nonfinite: str, max_consecutive_skips: Optional[int]) -> None:
        self.on_nonfinite = check_on_nonfinite(on_nonfinite)
        self.max_consecutive_skips = check_max_consecutive_skips(max_consecutive_skips)
        self.num_skipped = 0
        self.consecutive_skips = 0
        self.last_skipped = False

    def passed(self) -> None:
        """A step that was applied: the run of consecutive skips ends."""
        self.consecutive_skips = 0
        self.last_skipped = False

    def skipped(self, step: int, entries: Sequence[str]) -> None:
        """Record a step whose state was already put back; raise per the policy."""
        what = ", ".join(entries[:6]) + (f" (+{len(entries) - 6} more)" if len(entries) > 6 else "")
        self.last_skipped = True
        if self.on_nonfinite == "raise":
            raise NonFiniteError(
                f"KFACPreconditioner step {step}: non-finite {what} (on_nonfinite='raise'); the preconditioner's "
                "state and the gradients are unchanged")
        self.num_skipped += 1
        self.consecutive_skips += 1
        logger.warning("KFACPreconditioner step %d skipped: non-finite %s; factors, decompositions, steps and "
                       "gradients left unchanged, skip optimizer.step() (skipped so far: %d)",
                       step, what, self.num_skipped)
        limit = self.max_consecutive_skips
        if limit is not None and self.consecutive_skips >= limit:
            raise NonFiniteError(
                f"KFACPreconditioner: {self.consecutive_skips} consecutive steps were skipped (max_consecutive_skips="
                f"{limit}); the last one had non-finite {what}. The training diverged or the data holds NaN/inf: "
                "check the inputs and the loss, lower the learning rate, raise the damping (or kl_clip's "
                "restriction, a smaller kl_clip), or use gradient clipping; max_consecutive_skips=None never raises")
