"""The one exception type of the linear-algebra backends."""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["LinalgError", "remedy"]


def remedy(dtype: Any) -> str:
    """What to try after a failed decomposition in ``dtype``: more damping, and float64 unless it is."""
    return "increase damping" + ("" if str(dtype) == "torch.float64" else " or use dtype=torch.float64")


class LinalgError(ValueError):
    """A decomposition could not be computed.

    Raised for non-finite input, a matrix that is not positive definite (after
    damping), or a decomposition that did not converge. The message names the
    operation, the backend, the shape and dtype, and what to try next (usually more
    damping or ``dtype=torch.float64``). Subclasses :class:`ValueError` so callers
    that already catch bad-value errors keep working.
    """

    #: for a diagonal or full block whose damped eigenvalues ``scale·λ(C) + damping`` were not all positive:
    #: how much the damping falls short of making the smallest one positive (None otherwise)
    damping_shortfall: Optional[float] = None
