"""Announcing expensive blocks before they are computed (a ``logging`` warning with the size).

Two costs grow fast with a block's parameter count ``P``: a full block holds ``P²`` numbers and
its decomposition takes ``~9P³`` FLOPs (the optimizers' eigh), and the Hessian needs one
Hessian-vector product — a double backward over the whole batch — per row it computes.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Set

logger = logging.getLogger("curvature")

#: a full block above this many parameters is announced (P² = 4M numbers, 16 MB in float32)
FULL_WARN_PARAMS = 2048
#: a Hessian block needing more Hessian-vector products than this is announced
HVP_WARN = 1024


def time_class(flops_or_products: float, per_second: float) -> str:
    """``"seconds"``, ``"minutes"`` or ``"hours"`` for ``flops_or_products / per_second`` seconds."""
    s = flops_or_products / per_second
    return "well under a minute" if s < 30 else "minutes" if s < 1800 else "hours"


def full_block_message(name: str, p: int, itemsize: int, what: str) -> str:
    """The warning for a ``p × p`` full block of module ``name``."""
    n = p * p
    return (f"{what} full block of module {name!r}: {p} parameters -> {p}x{p} = {n:,} elements "
            f"({n * itemsize / 2 ** 20:,.0f} MiB); each decomposition (the optimizers': at every inverse update; a "
            f"Curvature from curvature.compute: at a solve with a new damping) is an eigendecomposition of "
            f"~{9 * p ** 3:.2g} FLOPs (expect {time_class(9 * p ** 3, 2e10)} on a CPU core); use approx='kfac' or "
            "'diag' for this module (approx={...: ...} per module) if that is too slow")


def warn_full_blocks(sizes: dict, itemsize: int, what: str) -> None:
    """Log one warning per full block of more than :data:`FULL_WARN_PARAMS` parameters
    (``sizes``: module name -> P)."""
    for name, p in sizes.items():
        if p > FULL_WARN_PARAMS:
            logger.warning(full_block_message(name, p, itemsize, what))


def warn_hessian_products(name: str, count: int, p: int, shape: str, announced: Optional[Set[Any]] = None) -> None:
    """Log a warning before a Hessian block that needs ``count`` Hessian-vector products, once per block and count
    where ``announced`` (the caller's set) remembers it (an optimizer's every step would repeat it)."""
    if count > HVP_WARN:
        if announced is not None:
            if (name, count, shape) in announced:
                return
            announced.add((name, count, shape))
        # ~1000 products a second: the chunked double backward of a small model on a CPU core (13,000/s for an
        # MLP 64-128-10 at batch 64), fewer for larger ones
        logger.warning(f"Hessian {shape} block of module {name!r} ({p} parameters): {count:,} Hessian-vector "
                       f"products, each a double backward over the batch (expect {time_class(count, 1000.0)}); "
                       "use a Fisher kind (kind='fisher' = GGN), whose K-FAC shape (approx='kfac') suits large "
                       "layers")
