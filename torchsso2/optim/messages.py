"""Messages of the optimizer faces that must say exactly what happened and what to try."""
from __future__ import annotations

from typing import Optional

import torch


def decomposition_failed(step: int, error: object, have_previous: bool,
                         decomposition_dtype: Optional[torch.dtype]) -> str:
    """The warning of a step whose decomposition failed (after the float64 and jitter retries of
    :mod:`curvature.linalg.eigh_retry`): which decomposition the step used — the previous one, or
    none, in which case the parameters were not updated — and what to try."""
    kept = ("every block keeps its previous decomposition for this step (none is replaced when one fails)"
            if have_previous else "there is no earlier decomposition, so this step leaves the parameters unchanged")
    hint = "increase damping" if decomposition_dtype == torch.float64 else \
        "pass decomposition_dtype=torch.float64 or increase damping"
    return f"step {step}: decomposition failed ({error}); {kept}; {hint}"
