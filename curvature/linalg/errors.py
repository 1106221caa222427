"""The one exception type of the linear-algebra backends."""
from __future__ import annotations

__all__ = ["LinalgError"]


class LinalgError(ValueError):
    """A decomposition could not be computed.

    Raised for non-finite input, a matrix that is not positive definite (after
    damping), or a decomposition that did not converge. The message names the
    operation, the backend, the shape and dtype, and what to try next (usually more
    damping or ``dtype=torch.float64``). Subclasses :class:`ValueError` so callers
    that already catch bad-value errors keep working.
    """
