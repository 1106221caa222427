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
#: a dense K-FAC factor of more rows than this is announced (each eigendecomposition ~9n³ = 6e11 FLOPs:
#: half a minute and more on a CPU core; an 8000-token LM head's 8000×8000 factor took 3 minutes a step)
KFAC_WARN_SIDE = 4096
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


def warn_kfac_factors(sides: dict, itemsize: int, fixes: str = "approx={{{name!r}: 'diag'}} for this module, a "
                      "longer inv_update_interval, or skip_modules", inverse: bool = False) -> None:
    """Log one warning per module whose K-FAC block has a dense factor of more than :data:`KFAC_WARN_SIDE`
    rows (``sides``: module name -> the dense factors' sizes; a diagonal factor, as an untied Embedding's
    token counts, is not listed). ``fixes``: what to do, formatted with the module's ``name``; ``inverse``:
    the factors are inverted by Cholesky (``~n³`` FLOPs), not eigendecomposed (``~9n³``)."""
    for name, ns in sides.items():
        big = [n for n in ns if n > KFAC_WARN_SIDE]
        if not big:
            continue
        flops = sum((1 if inverse else 9) * n ** 3 for n in big)
        mib = sum(n * n for n in big) * itemsize / 2 ** 20
        logger.warning(
            f"K-FAC block of module {name!r}: dense factor(s) of {' and '.join(f'{n}x{n}' for n in big)} "
            f"({mib:,.0f} MiB); each decomposition (an optimizer's inverse update; a Curvature from "
            f"curvature.compute: a solve at a new damping) is {'a Cholesky inverse' if inverse else 'an eigendecomposition'} "
            f"of ~{flops:.2g} FLOPs (expect {time_class(flops, 2e10)} on a CPU core). If that is too slow: "
            f"{fixes.format(name=name)} (a language model's output layer over its vocabulary, or an Embedding tied "
            "to it, is the usual case)")


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
