"""Messages of the optimizer faces that must say exactly what happened and what to try."""
from __future__ import annotations

from typing import Optional

import torch


def decomposition_failed(step: int, error: object, have_previous: bool,
                         decomposition_dtype: Optional[torch.dtype], indefinite: bool = False,
                         damping: float = 0.0, raised_to: Optional[float] = None) -> str:
    """The warning of a step whose decomposition failed (after the float64 and jitter retries of
    :mod:`curvature.linalg.eigh_retry`): which decomposition the step used — the previous one, or
    none, in which case the parameters were not updated — and what to try. ``indefinite``: a
    curvature that may have negative eigenvalues (the Hessian), which more precision does not fix.
    ``damping``: the shift added to the curvature; beyond the largest float32 it is the cause in float32.
    ``raised_to``: the damping ``adaptive_damping`` raised it to, which the next decomposition takes."""
    kept = ("every block keeps its previous decomposition for this step (none is replaced when one fails)"
            if have_previous else "there is no earlier decomposition, so this step leaves the parameters unchanged")
    big = torch.finfo(torch.float32).max
    if raised_to is not None:
        hint = (f"adaptive_damping raised the damping from {damping:g} to {raised_to:g} for the next decomposition"
                + (" (the Hessian may be indefinite)" if indefinite else ""))
    elif decomposition_dtype != torch.float64 and damping > big:
        hint = (f"the damping {damping:g} is beyond the largest float32 ({big:.2e}): pass "
                "decomposition_dtype=torch.float64 or a smaller damping")
    elif indefinite:
        hint = "the Hessian may be indefinite: increase damping above its most negative eigenvalue"
    elif decomposition_dtype == torch.float64:
        hint = "increase damping"
    else:
        hint = "pass decomposition_dtype=torch.float64 or increase damping"
    return f"step {step}: decomposition failed ({error}); {kept}; {hint}"
