"""The factor by which a closure's loss weighs the data, measured on its gradient with respect to the output.

A loss ``c``× the mean negative log-likelihood (``F.mse_loss`` of D outputs: ``2/D``; ``reduction="sum"``: the
rows) makes the step ``c``× what the optimizer's curvature assumes. ``c = ⟨g, r⟩/⟨r, r⟩`` with ``g`` the
closure loss's gradient with respect to the (selected) output, seen by the closure watch
(:class:`~torchsso2.optim.misuse.ClosureWatch`, ``keep_output_grads``), and ``r`` the mean NLL's gradient at
the same output: a constant in the loss (``log 2π``, ``log σ²``) does not count, as it does not in the step.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import Tensor

from curvature.likelihoods import check_outputs_targets
from curvature.stacklevel import caller_stacklevel

from .lm_forward import _mean_nll, nll_description

#: ``|c − 1|`` beyond which a closure's loss is warned about: the scale mistakes are 2/3× (``F.mse_loss`` of 3
#: outputs) or further off, while deliberate other likelihoods stay within it (label smoothing 0.1 on near-uniform
#: first predictions: c ≈ 0.9; moderate class weights)
GRADIENT_FACTOR_RTOL = 0.3


def gradient_factor(opt: Any, targets: Optional[Tensor], seen: Any) -> Optional[float]:
    """``c = ⟨g, r⟩/⟨r, r⟩``: the closure loss's output gradient ``g`` (one observed forward) against the mean
    NLL's ``r`` at the same output; None where it cannot be told (no targets, not one forward seen, targets
    that do not fit, a zero ``r``)."""
    if not isinstance(targets, Tensor) or not seen or len(seen) != 1:
        return None
    out, g = seen[0]
    if out.shape != g.shape or out.dtype not in (torch.float32, torch.float64):
        return None
    try:
        check_outputs_targets(opt.engine.loss, out, targets)
        with torch.enable_grad():
            leaf = out.detach().requires_grad_(True)
            r, = torch.autograd.grad(_mean_nll(opt.engine.loss, leaf, targets), leaf)
    except (RuntimeError, ValueError, IndexError, TypeError):
        return None
    rr = float((r.double() * r.double()).sum())
    if not rr > 0:
        return None
    # a GradScaler given to the optimizer scaled the backward (the output's gradient too) by its scale
    scale = float(opt.grad_scaler.get_scale()) if getattr(opt, "grad_scaler", None) is not None else 1.0
    return float((g.double() * r.double()).sum()) / rr / scale


def warn_if_gradient_is_not_the_nll(opt: Any, targets: Optional[Tensor], seen: Any, who: str,
                                    consequence: str) -> bool:
    """Warn when :func:`gradient_factor` is off 1 by more than :data:`GRADIENT_FACTOR_RTOL` (``who``: the
    warning's subject; ``consequence``: what the factor does). Returns whether it could tell."""
    factor = gradient_factor(opt, targets, seen)
    if factor is None:
        return False
    if abs(factor - 1.0) > GRADIENT_FACTOR_RTOL:
        warnings.warn(f"{who}: the gradient of the closure's loss with respect to the output is {factor:.4g}× that "
                      f"of the mean negative log-likelihood of the output and the targets (loss="
                      f"{opt.engine.loss.value!r}: {nll_description(opt.engine.loss)}). {consequence}", UserWarning,
                      stacklevel=caller_stacklevel())
    return True
